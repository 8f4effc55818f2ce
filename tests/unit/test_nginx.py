"""deploy/nginx's rendered config, in process (batchserve behind a real nginx is tests/integration/test_nginx.py)."""

from __future__ import annotations

import re

import pytest

from deploy.nginx.render import render


def test_render_lists_every_backend_with_the_retry_settings():
    text = render(["10.0.0.1:8000", "[::1]:8001", "node-3.example:8000"], listen="8080")
    assert re.findall(r"server (\S+) max_fails=0;", text) == ["10.0.0.1:8000", "[::1]:8001", "node-3.example:8000"]
    assert "listen 8080 backlog=4096;" in text and "@" not in text.replace("@no_upstream", "").replace(
        "@upstream_timeout", ""
    ).replace("@too_large", "")
    with pytest.raises(ValueError):
        render(["10.0.0.1"])
