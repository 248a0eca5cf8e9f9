"""Typed errors: every failure a user can cause has one, under `SpecEdgeError`.

Messages say what was asked and what is available, e.g.
``bundle built for S_max=2048, request needs 2311 (prompt 2200 + max_new 100 + K+1 11)``.
"""


class SpecEdgeError(Exception):
    """Base class of every error specedge raises on purpose."""


class BundleError(SpecEdgeError):
    """A bundle is missing, corrupt, or inconsistent with its manifest."""


class ContextLengthError(SpecEdgeError):
    """A request does not fit the bundle's fixed KV buffers (S_max)."""


class SamplingParamsError(SpecEdgeError, ValueError):
    """Invalid sampling or generation parameters."""


class PromptError(SpecEdgeError, ValueError):
    """An empty or malformed prompt / chat message list."""


class VocabularyMismatchError(SpecEdgeError):
    """Draft and target do not share a tokenizer (token -> id map)."""


class BackendUnavailableError(SpecEdgeError):
    """The requested backend is not installed or not built for this bundle."""


class OptionError(SpecEdgeError, ValueError):
    """An invalid option of the API or CLI (verify mode, thread count, a closed decoder, ...)."""


class OutOfMemoryError(SpecEdgeError, MemoryError):
    """A bundle's fixed buffers (the KV cache at S_max) cannot be allocated on this machine."""


class UnsupportedModelError(SpecEdgeError):
    """A model architecture, tensor type or option specedge does not support."""
