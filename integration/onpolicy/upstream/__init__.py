"""Patch-series tool: fetch pinned upstreams, apply, export, check, rebase, status.

Standard library and git only, so it runs before anything else is installed.
"""

from onpolicy.upstream.errors import UpstreamError

__all__ = ["UpstreamError"]
