"""Settings come from the environment; Vast mode only where the platform or the template says so."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from worker.settings import Settings


def test_env_names_and_aliases(monkeypatch):
    monkeypatch.setenv("GLMFLASH_PORT", "4100")
    monkeypatch.setenv("API_KEY", "k")
    monkeypatch.setenv("MODEL_NAME", "org/model@abc")
    s = Settings()
    assert (s.port, s.api_key, s.model) == (4100, "k", "org/model@abc")


def test_vast_mode(monkeypatch):
    for name in ("CONTAINER_ID", "REPORT_ADDR", "GLMFLASH_VAST"):
        monkeypatch.delenv(name, raising=False)
    assert not Settings().vast_mode
    monkeypatch.setenv("CONTAINER_ID", "123")
    assert not Settings().vast_mode  # an ordinary Vast instance serves plain OpenAI
    monkeypatch.setenv("GLMFLASH_VAST", "1")
    s = Settings()
    assert s.vast_mode and s.vast_report_addr == "https://run.vast.ai"
    monkeypatch.setenv("REPORT_ADDR", "http://controller:9")
    assert Settings().vast_report_addr == "http://controller:9"


def test_tiny_model_runs_on_cpu_unless_asked(monkeypatch):
    for name in ("GLMFLASH_MODEL", "MODEL_NAME", "GLMFLASH_S3_URI", "GLMFLASH_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    assert Settings().resolved_device() == "cpu" and Settings().resolved_dtype() == "float32"
    assert Settings(device="cuda").resolved_device() == "cuda"


def test_worker_port_is_the_listen_port_under_vast(monkeypatch):
    monkeypatch.setenv("WORKER_PORT", "18000")
    assert Settings().port == 18000
    monkeypatch.setenv("GLMFLASH_PORT", "3001")  # an explicit setting of ours wins
    assert Settings().port == 3001


def test_ready_at_is_loaded_or_partial(monkeypatch):
    assert Settings().ready_at == "loaded"
    monkeypatch.setenv("GLMFLASH_READY_AT", "partial")
    assert Settings().ready_at == "partial"
    monkeypatch.setenv("GLMFLASH_READY_AT", "soon")
    with pytest.raises(ValidationError, match="GLMFLASH_READY_AT[\\s\\S]*'loaded' or 'partial'"):
        Settings()


def test_offload_settings_are_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("GLMFLASH_EXPERT_CALIBRATION", str(tmp_path / "missing.txt"))
    with pytest.raises(ValidationError, match="(?i)GLMFLASH_EXPERT_CALIBRATION[\\s\\S]*file"):
        Settings()
    (tmp_path / "prompts.txt").write_text("one prompt\n")
    monkeypatch.setenv("GLMFLASH_EXPERT_CALIBRATION", str(tmp_path / "prompts.txt"))
    monkeypatch.setenv("GLMFLASH_PCIE_EXPERT_PERCENT", "101")
    with pytest.raises(ValidationError, match="GLMFLASH_PCIE_EXPERT_PERCENT"):
        Settings()
    monkeypatch.setenv("GLMFLASH_PCIE_EXPERT_PERCENT", "40")
    settings = Settings()
    assert settings.pcie_expert_percent == 40 and settings.expert_calibration == tmp_path / "prompts.txt"


def test_kernel_precompile_processes_reach_the_engine(monkeypatch):
    from worker.engine_options import engine_options

    monkeypatch.delenv("GLMFLASH_KERNEL_PRECOMPILE_PROCESSES", raising=False)
    assert engine_options(Settings()).precompile_processes is None  # by the cores
    monkeypatch.setenv("GLMFLASH_KERNEL_PRECOMPILE_PROCESSES", "0")
    assert engine_options(Settings()).precompile_processes == 0  # compile in the server
    monkeypatch.setenv("GLMFLASH_KERNEL_PRECOMPILE_PROCESSES", "-1")
    with pytest.raises(ValidationError):
        Settings()


def test_the_lone_prefill_budget_reaches_the_engine(monkeypatch):
    from worker.engine_options import engine_options

    monkeypatch.delenv("GLMFLASH_MAX_PREFILL_TOKENS", raising=False)
    assert engine_options(Settings()).max_prefill_tokens is None  # the step budget's
    monkeypatch.setenv("GLMFLASH_MAX_PREFILL_TOKENS", "8192")
    assert engine_options(Settings()).max_prefill_tokens == 8192
    monkeypatch.setenv("GLMFLASH_MAX_PREFILL_TOKENS", "0")
    with pytest.raises(ValidationError, match="GLMFLASH_MAX_PREFILL_TOKENS"):
        Settings()
