"""What the decoding engine's test modules share: SmolLM2 on the CPU (`model`, module-scoped as in
test_static_decode), imported once here rather than into each module (an import there is shadowed by the
parameter, which pyflakes rightly reports as F811)."""

from __future__ import annotations

from tests.integration.backends.test_static_decode import model  # noqa: F401
