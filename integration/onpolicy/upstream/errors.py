"""The one error type the patch tool raises; the CLI prints its message and exits 2."""


class UpstreamError(Exception):
    """A refused operation. The message names the rule and the values involved."""
