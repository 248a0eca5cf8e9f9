"""Deployment presets (TOML), shipped as package data; see specedge.runtime.config."""
