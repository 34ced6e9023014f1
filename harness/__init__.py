"""qwen35-harness: verify that an inference engine runs Qwen3.5 correctly (docs/design.md)."""

from harness import moved as _moved

_moved.install()
