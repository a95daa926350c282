"""The CPU backend: pure torch, every reduction spelled out in the fixed tree order; `ops` is
its surface, the primitive names the dispatcher looks up."""
