"""API keys over real HTTP: who gets in where, the error shape, the settings (flag, env, YAML), and keys
kept out of every dump of the config."""

from __future__ import annotations

import argparse
import logging
import uuid

import httpx
import pytest

from cluster.config import ClusterConfig
from cluster.serve_cmd import apply_flags
from router.app import create_app
from router.auth import AuthConfig
from router.state import RouterConfig
from router.worker_client import LocalWorkerClient
from tests.router.serve import serve_app

API, ADMIN = "sk-user-123", "sk-admin-456"


def serve(redis_url, tokenizer, auth: AuthConfig):  # type: ignore[no-untyped-def]
    config = RouterConfig(redis_url, f"auth-{uuid.uuid4().hex[:8]}", served_model_name="m", auth=auth)
    return serve_app(create_app(config, LocalWorkerClient({}), tokenizer))


@pytest.fixture(scope="module")
def keyed(redis_url, default_model_and_tokenizer):  # type: ignore[no-untyped-def]
    served = serve(redis_url, default_model_and_tokenizer[1], AuthConfig((API,), (ADMIN,)))
    yield served.url
    served.stop()


def call(url: str, method: str, path: str, key: str | None = None, scheme: str = "Bearer") -> httpx.Response:
    headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if method == "POST" else None
    return httpx.request(method, url + path, headers=headers, json=body, timeout=30)


@pytest.mark.parametrize(("path", "method"), [("/v1/models", "GET"), ("/v1/chat/completions", "POST"),
                                             ("/tokenize", "POST"), ("/version", "GET"), ("/openapi.json", "GET")])
def test_the_api_needs_a_key(keyed, path, method) -> None:
    for key, scheme, code in [(None, "Bearer", "missing_api_key"), ("wrong", "Bearer", "invalid_api_key"),
                              (API, "Basic", "missing_api_key"), (API[:-1], "Bearer", "invalid_api_key")]:
        response = call(keyed, method, path, key, scheme)
        assert response.status_code == 401, (key, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]
    assert call(keyed, "GET", "/v1/models", API).status_code == 200
    assert call(keyed, "GET", "/v1/models", ADMIN).status_code == 200  # the admin key serves the API too


def test_cluster_endpoints_need_the_admin_key(keyed) -> None:
    assert call(keyed, "GET", "/cluster/status").status_code == 401
    refused = call(keyed, "GET", "/cluster/status", API)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert call(keyed, "GET", "/cluster/status", ADMIN).status_code == 200
    assert call(keyed, "POST", "/cluster/scale", API).status_code == 403  # refused before the body is read


def test_probes_and_metrics_stay_open(keyed, redis_url, default_model_and_tokenizer) -> None:
    assert call(keyed, "GET", "/health").status_code == 200
    assert call(keyed, "GET", "/ready").status_code in (200, 503)  # no workers here: not ready, but not 401
    assert call(keyed, "GET", "/metrics").status_code == 200
    closed = serve(redis_url, default_model_and_tokenizer[1], AuthConfig((API,), metrics_need_key=True))
    try:
        assert call(closed.url, "GET", "/metrics").status_code == 401
        assert call(closed.url, "GET", "/metrics", API).status_code == 200
        assert call(closed.url, "GET", "/cluster/status", API).status_code == 200  # no admin key: the API key
    finally:
        closed.stop()


def test_an_admin_key_alone_guards_only_the_cluster_endpoints(redis_url, default_model_and_tokenizer) -> None:
    served = serve(redis_url, default_model_and_tokenizer[1], AuthConfig(admin_keys=(ADMIN,)))
    try:
        assert call(served.url, "GET", "/v1/models").status_code == 200
        assert call(served.url, "GET", "/cluster/status").status_code == 401
        assert call(served.url, "GET", "/cluster/status", ADMIN).status_code == 200
        assert ADMIN not in repr(AuthConfig((API,), (ADMIN,)))
    finally:
        served.stop()


def test_no_key_configured_leaves_everything_open(redis_url, default_model_and_tokenizer) -> None:
    served = serve(redis_url, default_model_and_tokenizer[1], AuthConfig())
    try:
        assert call(served.url, "GET", "/v1/models").status_code == 200
        assert call(served.url, "GET", "/cluster/status").status_code == 200
    finally:
        served.stop()


def test_keys_come_from_flags_env_and_yaml_and_never_show(monkeypatch, caplog) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", "sk-from-env")
    monkeypatch.delenv("TANDEM_ADMIN_KEY", raising=False)
    base = ClusterConfig.model_validate({"router": {"api_keys": ["sk-from-yaml"]}})
    args = argparse.Namespace(prefill=None, decode=None, host=None, port=None, redis=None, ray_address=None,
                              api_key=["sk-from-flag"], admin_key=["sk-admin-flag"])
    with caplog.at_level(logging.DEBUG):
        config = apply_flags(base, args)
    auth = config.router.auth_config()
    assert auth.api_keys == ("sk-from-yaml", "sk-from-flag", "sk-from-env") and auth.admin_keys == ("sk-admin-flag",)
    dumped = str(config.model_dump(mode="json")) + repr(config) + str(config)  # what /cluster/config serves
    assert not any(key in dumped or key in caplog.text
                   for key in ("sk-from-yaml", "sk-from-flag", "sk-from-env", "sk-admin-flag"))


def test_apply_does_not_compare_keys() -> None:
    """A cluster started with TANDEM_API_KEY shows ********** where its file has no key: not a difference."""
    from cluster.scale_cmd import live_changes

    running = ClusterConfig.model_validate({"router": {"api_keys": ["sk-env"]}}).model_dump(mode="json")
    wanted = ClusterConfig().model_dump(mode="json")
    assert running["router"]["api_keys"] == ["**********"]
    _, others = live_changes(running, wanted)
    assert others == []
    wanted["router"]["port"] = 9000
    assert live_changes(running, wanted)[1] == ["router.port (8000 -> 9000)"]
