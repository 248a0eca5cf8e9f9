"""specedge.runtime: torch-free speculative decoding over static-shape bundles.

    from specedge.runtime import SpecDecoder, SamplingParams
    dec = SpecDecoder.load("engines/smollm2")
    print(dec.generate("def fib(n):", SamplingParams(max_new_tokens=64)).text)
"""

__version__ = "0.2.0"

from .decoder import SpecDecoder  # noqa: E402
from .errors import (  # noqa: E402
    BackendUnavailableError,
    BundleError,
    ContextLengthError,
    OptionError,
    OutOfMemoryError,
    PromptError,
    SamplingParamsError,
    SpecEdgeError,
    UnsupportedModelError,
    VocabularyMismatchError,
)
from .manifest import Manifest, read_manifest  # noqa: E402
from .request import GenerationResult, StreamEvent  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .stats import Stats  # noqa: E402

__all__ = [
    "SpecDecoder", "SamplingParams", "StreamEvent", "GenerationResult", "Stats", "Manifest", "read_manifest",
    "SpecEdgeError", "BundleError", "ContextLengthError", "PromptError", "SamplingParamsError",
    "VocabularyMismatchError", "BackendUnavailableError", "UnsupportedModelError", "OptionError",
    "OutOfMemoryError",
]
