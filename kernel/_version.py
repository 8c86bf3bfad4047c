"""The kernel's version, on the base floor: the front doors name it (the handshake,
``tak --version``) without importing the package's public face above them."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
