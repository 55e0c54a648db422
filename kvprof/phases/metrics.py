"""Phase windows from a serving engine's Prometheus `/metrics`, scraped at 10 Hz, or less often
where the engine takes long to render its page (`MetricsSource.share`).

Each scrape is stamped (CLOCK_MONOTONIC) at receipt, and the interval since the previous one is
labelled from how far the engine's prefill and decode counters moved (`step_phase`); intervals
of one label merge into windows (`windows.Track`), so an edge is within a scrape interval of
where the counters, not the compute, moved. Each engine's counters, the corrections made for
them, engine names, failures: docs/phases.md, "What the metrics sources can tell"."""
from __future__ import annotations

import http.client
import json
import math
import statistics
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from kvprof import schema
from kvprof.errors import EX_USAGE, KvprofError
from kvprof.phases.base import PhaseSource, step_phase
from kvprof.phases.exposition import Sample, parse_exposition
from kvprof.phases.windows import Track

# -- windows from counter intervals --------------------------------------------------------

# Confidence of time inferred from a busy gauge rather than counted.
INFERRED_CONFIDENCE = 0.5


@dataclass(frozen=True)
class Carve:
    """What the engine measured of the prefills that completed in one scrape interval."""
    prefill_ns: int  # how long they ran
    after_ns: int = 0  # decode time after their first tokens, up to the scrape
    beside: bool = False  # other requests went on decoding meanwhile
    # One request finished in the interval too: its decode time (last token - first), so
    # its end is known from where its own prefill ended. None where not exactly one.
    finished_decode_ns: int | None = None


@dataclass(frozen=True)
class Ended:
    """An interval after which the engine ran nothing, its one request having finished."""
    decode_ns: int  # that request's decode time (last token - first)
    steps_ns: int  # the inter-token time counted in the interval


class WindowTrack(Track):
    """The windows of one engine, fed consecutive scrape intervals. Not thread-safe.

    `step()` and `close()` return finished phase rows. A busy-but-quiet interval (the engine
    says work is in flight, no counter moved) is held until the next counted interval says
    what it was: the start of a prefill, the open window going on, or else a gap."""

    def __init__(self, engine: str, counts_are_tokens: bool = True) -> None:
        super().__init__("metrics", engine)
        self.counts_are_tokens = counts_are_tokens
        self.busy_since: int | None = None
        self.last_end = 0  # where the last window ended: later windows start at or after it
        self.last_first: int | None = None  # where the last carved prefill ended

    def close(self, end_ns: int | None = None) -> list[dict]:
        self.busy_since = None
        rows = super().close(end_ns)
        for row in rows:
            self.last_end = max(self.last_end, row["end_ns"])
        return rows

    def step(self, t0: int, t1: int, prefill: int, decode: int, busy: bool = False,
             confidence: float = 1.0, carve: Carve | None = None,
             ended: Ended | None = None) -> list[dict]:
        """Label [t0, t1). Where the engine says how long the prefills that completed in it
        ran (`carve`), they are carved out by time (see `_carve`). `ended`: the engine ran
        nothing at t1, its last request having finished in the interval: the decode window
        ends where it did, not at t1."""
        phase = step_phase(prefill, decode)
        out: list[dict] = []
        if prefill and carve is not None:
            self.busy_since = None
            return self._carve(t0, t1, prefill, decode, carve)
        if phase == "decode" and ended is not None and self.busy_since is None:
            # Its stream's steps follow each other from its first token: the engine went
            # idle at first token + decode time. Without this the window would reach the
            # scrape, and a prefill that began meanwhile would be cut at the window's end.
            # The steps counted here came after the last scrape read the counters: the end
            # is no earlier than t0 + their time (a scrape answered late can otherwise put
            # the end before t0).
            done = t0 + ended.steps_ns
            if self.last_first is not None:
                done = max(done, self.last_first + ended.decode_ns)
            self.last_first = None  # (that request is over: a later finish is another's)
            out += self.add(phase, t0, min(t1, done), INFERRED_CONFIDENCE, (0, decode))
            return out + self.close()
        if phase == "idle":
            if busy:
                if self.busy_since is None:
                    self.busy_since = t0
                return out
            # The window ends where counted work last was, not where the held span began.
            return self.close()
        span, self.busy_since = self.busy_since, None
        if span is not None:
            if self.open is not None and self.open.phase == phase:
                # The same work went on; the counters just did not tick.
                self.open.extend(span, t0, INFERRED_CONFIDENCE)
            elif phase in ("prefill", "mixed"):
                # With nothing counted and requests running, they were prefilling (a decode
                # step would have counted a token); the completion is what finally counts.
                out += self.close()
                out += self.add("prefill", span, t0, INFERRED_CONFIDENCE)
                if phase == "mixed":
                    out += self.close()
            else:
                out += self.close()
        tokens = (prefill, decode) if self.counts_are_tokens else None
        return out + self.add(phase, t0, t1, confidence, tokens)

    def _carve(self, t0: int, t1: int, prefill: int, decode: int, c: Carve) -> list[dict]:
        """An interval in which prefills completed, split by what the engine measured: they ran
        `prefill_ns`, their first tokens at most `after_ns` (the decode counted after them)
        before t1, reaching back over quiet intervals (an idle engine shows no running request
        until its first step's output) but never before the last window's end, nor before the
        end of a request that finished here (one stream's steps do not overlap). Mixed where
        others went on decoding (`beside`); decode counted after the first tokens follows, open.
        Placed to within a scrape interval (inferred confidence); length, tokens the engine's."""
        out: list[dict] = []
        w = self.open
        touching = w is not None and w.end_ns == t0
        # (the requests beside them must have been decoding up to this interval)
        decoding = c.beside and touching and \
            w.phase in ("decode", "mixed")  # type: ignore[union-attr]
        floor = max(self.last_end, w.end_ns if w is not None else 0)
        first = max(t0, t1 - c.after_ns)
        done = t0  # where the request that finished here ended, if one did
        if c.finished_decode_ns is not None and self.last_first is not None and not decoding:
            # The request before ended here; this prefill began after it.
            done = max(t0, min(t1, self.last_first + c.finished_decode_ns))
            floor = max(floor, done)
            first = max(first, done + c.prefill_ns)
        first = min(t1, first)
        start = max(first - c.prefill_ns, floor)
        if touching and w.phase == ("mixed" if decoding else "prefill"):  # type: ignore[union-attr]
            start = t0  # the same work went on from the last interval: no gap in between
        if start >= first:  # (nothing measurable left: the interval as the counters say)
            return self.add(step_phase(prefill, decode), t0, t1, INFERRED_CONFIDENCE,
                            (prefill, decode) if self.counts_are_tokens else None)
        after = bool(decode) and first < t1
        if done > t0:
            # The finished request's last steps came before this prefill: its decode, with
            # the decode tokens shared by time between it and the new request's first steps.
            before = decode if not after else round(decode * (done - t0) /
                                                    ((done - t0) + (t1 - first)))
            out += self.add("decode", t0, done, INFERRED_CONFIDENCE, (0, before))
            decode -= before
            after = bool(decode) and first < t1
        w = self.open
        if w is not None and start > w.end_ns:
            out += self.close()
        out += self.add("mixed" if decoding or (decode and not after) else "prefill", start,
                        first, INFERRED_CONFIDENCE, (prefill, 0 if after else decode))
        self.last_first = first
        if after:
            out += self.add("decode", first, t1, INFERRED_CONFIDENCE, (0, decode))
        return out


# -- the scraper -----------------------------------------------------------------------------


@dataclass
class Reading:
    """One engine's totals at one scrape: named counters (missing = 0) and whether the
    engine says work is in flight (None when it has no such gauge)."""
    counters: dict[str, float] = field(default_factory=dict)
    busy: bool | None = None
    running: int | None = None  # requests the engine runs, where it says


@dataclass(frozen=True)
class Step:
    prefill: int
    decode: int
    busy: bool = False
    confidence: float = 1.0
    carve: Carve | None = None  # what the engine measured of the prefills completed in it
    ended: Ended | None = None  # the engine went idle after its last request finished


def _engine_name(base: str, rank: str) -> str:
    return f"{base}#{rank}" if rank else base


def check_url(url: str) -> str:
    """The scrape URL, with /metrics added when only host:port was given."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise KvprofError(f"metrics URL {url!r} is not http(s)://host:port/path", EX_USAGE)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


class _ScrapeFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


# Counter series (and a histogram's), by the names Prometheus clients give them.
COUNTED = ("_total", "_sum", "_count", "_bucket")


class MetricsSource(PhaseSource):
    """Scrapes one /metrics endpoint and turns counter deltas into phase windows.

    Subclasses say which series count prefill and decode (`read`) and how an interval's
    deltas split (`split`)."""

    name = "metrics"
    kind = "engine"
    default_url = "http://127.0.0.1/metrics"
    interval_s = 0.1
    # The engine renders its page on the thread that serves its API (vLLM's 51 kB: ~4 ms on
    # 2 vCPUs), so a scrape costs it about the scrape's response time. Scrapes come at most
    # every interval_s and no more often than keeps that time within `share` of the engine's
    # (the median of the last five responses, from the third on: the first comes over a new
    # connection from a cold page), nor less often than max_interval_s. A scrape that timed
    # out counts as a response of timeout_s.
    share = 0.01
    max_interval_s = 1.0
    paced_after = 3
    timeout_s = 0.5
    max_retry_s = 2.0
    max_body_bytes = 16 << 20
    counts_are_tokens = True
    # Samples whose names start with these go to the engine_metric table when they change.
    engine_metric_prefixes: tuple[str, ...] = ()
    # The series `read` looks at; only these and the engine_metric ones are kept from a scrape.
    phase_series: frozenset[str] = frozenset()
    # Every metric of this engine starts so; an endpoint without any is the wrong one.
    family_prefix = ""
    # True where the engine creates its counter series on first use, so that their absence
    # while it has served nothing is normal and only a missing family is a problem.
    lazy_series = False

    def __init__(self, url: str | None = None, engine: str | None = None) -> None:
        super().__init__()
        self.url = check_url(url or self.default_url)
        self.engine_override = engine or None
        # Metrics endpoints are local to the host; an http_proxy meant for the outside
        # world must not catch them.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._prev_ts: int | None = None
        self._prev: dict[str, Reading] = {}
        self._tracks: dict[str, WindowTrack] = {}
        self._last_values: dict[tuple[str, str], float] = {}
        self._retry_s = 0.0
        self._retry_at = 0.0
        self._missing = False
        self.scrapes = 0  # successful scrapes, for status lines and tests
        self._response_s: deque[float] = deque(maxlen=5)
        self.longest_gap_s = 0.0  # between consecutive good scrapes, for the session row

    # -- per engine ---------------------------------------------------------------------------
    def engine_of(self, model: str = "", rank: str = "") -> str:
        base = self.engine_override or (f"{self.kind}:{model}" if model else self.kind)
        return _engine_name(base, rank)

    def wants(self, name: str) -> bool:
        return name in self.phase_series or self._kept(name)

    def _kept(self, name: str) -> bool:
        """A series written to engine_metric: the engine's offload counters and the serving
        figures' counters (schema.ENGINE_SERIES: TTFT, inter-token latency, tokens, prefix
        cache), never a _created timestamp."""
        return ((name.startswith(self.engine_metric_prefixes) or name in schema.ENGINE_SERIES)
                and not name.endswith("_created"))

    def read(self, samples: list[Sample]) -> dict[str, Reading]:
        raise NotImplementedError

    def split(self, delta: dict[str, float], before: Reading, now: Reading,
              interval_s: float) -> Step:
        raise NotImplementedError

    # -- scraping -------------------------------------------------------------------------------
    def _fetch(self) -> bytes:
        req = urllib.request.Request(self.url, headers={
            # Classic text, not OpenMetrics: prometheus_client serves either on request.
            "Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1",
            "User-Agent": "kvprof"})
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                body = resp.read(self.max_body_bytes + 1)
        except urllib.error.HTTPError as e:
            raise _ScrapeFailed("http_error", f"{self.url}: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise _ScrapeFailed("unreachable", f"{self.url}: {reason}") from None
        except http.client.HTTPException as e:  # a malformed or cut-off response
            raise _ScrapeFailed("http_error", f"{self.url}: {type(e).__name__} {e}") from None
        if len(body) > self.max_body_bytes:
            raise _ScrapeFailed("too_large", f"{self.url}: over {self.max_body_bytes} bytes")
        return body

    def poll(self) -> None:
        if time.monotonic() < self._retry_at:
            return
        try:
            t0 = time.monotonic_ns()
            body = self._fetch()
            ts_ns = time.monotonic_ns()  # stamped at receipt: the counters are at most this new
            self._pace((ts_ns - t0) / 1e9)
            try:
                text = body.decode("utf-8")
                samples = parse_exposition(text, keep=self.wants)
            except ValueError as e:  # UnicodeDecodeError is one too
                raise _ScrapeFailed("bad_exposition", f"{self.url}: {e}") from None
            # Series created on first use are absent before it, but their HELP/TYPE lines
            # are there from the start: any mention says this is the engine's endpoint.
            family = self.family_prefix in text
        except _ScrapeFailed as e:
            took_s = (time.monotonic_ns() - t0) / 1e9
            if took_s >= self.timeout_s:  # the engine too slow to answer at all
                self._pace(took_s)
            self._failed(e.kind, str(e))
            return
        self._retry_s = 0.0
        self.scrapes += 1
        if self._prev_ts is not None:  # (none after a failure: no window spans one)
            self.longest_gap_s = max(self.longest_gap_s, (ts_ns - self._prev_ts) / 1e9)
        self.ingest(ts_ns, samples, family)

    def _pace(self, response_s: float) -> None:
        """The interval to the next scrape, from how long the engine took to answer."""
        self._response_s.append(response_s)
        if len(self._response_s) < self.paced_after:
            return
        cost_s = statistics.median(self._response_s) / self.share
        self.interval_s = min(self.max_interval_s, max(type(self).interval_s, cost_s))

    def pace(self) -> dict[str, float]:
        """The longest time between two consecutive good scrapes (every window edge is within
        one such gap) and the engine's median response time at the end."""
        if not self.longest_gap_s:
            return {}
        return {"scrape_interval_s": round(self.longest_gap_s, 3),
                "response_ms": round(statistics.median(self._response_s) * 1e3, 2)}

    def _failed(self, kind: str, detail: str) -> None:
        self.problem(kind, detail)
        # Nothing is known from the last good scrape on: windows end there, and the next
        # good scrape is only a baseline, so an outage never becomes one long window.
        self._end_all()
        self._prev_ts, self._prev = None, {}
        self._retry_s = min(self.max_retry_s, max(self.interval_s, self._retry_s * 2))
        self._retry_at = time.monotonic() + self._retry_s

    def _end_all(self, end_ns: int | None = None) -> None:
        for track in self._tracks.values():
            self._emit_rows(track.close(end_ns))

    def _emit_rows(self, rows: list[dict]) -> None:
        for row in rows:
            self.emit("phase", row)

    def ingest(self, ts_ns: int, samples: list[Sample], family: bool | None = None) -> None:
        """Take one scrape's samples, stamped ts_ns (exposed for tests and replays). family:
        whether the whole scrape had any of the engine's metrics (default: from samples)."""
        self._record_engine_metrics(ts_ns, samples)
        readings = {k: r for k, r in self.read(samples).items() if r.counters}
        if family is None:
            family = any(s.name.startswith(self.family_prefix) for s in samples)
        missing = not family or (not readings and not self.lazy_series)
        if missing and not self._missing:
            self.problem("missing_metrics", f"{self.url}: no {self.family_prefix}* phase "
                         f"counters; is this {self.kind}'s /metrics, with metrics on?")
        self._missing = missing
        prev_ts, prev = self._prev_ts, self._prev
        self._prev_ts, self._prev = ts_ns, readings
        if prev_ts is None:
            return
        for engine in set(self._tracks) - set(readings):
            self._emit_rows(self._tracks.pop(engine).close())
        for engine, now in readings.items():
            # A series first seen during a run started at 0 (client libraries create labelled
            # series on first use); one that vanished reads as 0 and so as a reset.
            last = prev.get(engine, Reading())
            before = last.counters
            delta = {k: now.counters.get(k, 0.0) - before.get(k, 0.0)
                     for k in set(before) | set(now.counters)}
            track = self._tracks.get(engine)
            if track is None:
                track = self._tracks[engine] = WindowTrack(engine, self.counts_are_tokens)
            backwards = sorted(k for k, v in delta.items() if v < 0)
            if backwards:
                self.problem("counter_reset", f"{engine}: {', '.join(backwards)} went back")
                self._emit_rows(track.close())
                continue
            step = self.split(delta, last, now, (ts_ns - prev_ts) / 1e9)
            self._emit_rows(track.step(prev_ts, ts_ns, step.prefill, step.decode, step.busy,
                                       step.confidence, step.carve, step.ended))

    def _record_engine_metrics(self, ts_ns: int, samples: list[Sample]) -> None:
        seen: dict[tuple[str, str], float] = {}
        for s in samples:
            if not self._kept(s.name):
                continue
            key = (s.name, json.dumps(s.labels, sort_keys=True))
            last = self._last_values.get(key)
            same = last is not None and (last == s.value or (math.isnan(last) and
                                                             math.isnan(s.value)))
            if last is None and self._prev_ts is not None and s.name.endswith(COUNTED):
                # A counter first seen after the first scrape started at 0 since the last
                # one (client libraries create labelled series on first use): what it holds
                # moved in this session.
                self.emit("engine_metric", {"ts_ns": self._prev_ts,
                                            "engine": self.engine_for(s.labels),
                                            "name": s.name, "labels": key[1], "value": 0.0})
            if not same:
                self.emit("engine_metric", {"ts_ns": ts_ns, "engine": self.engine_for(s.labels),
                                            "name": s.name, "labels": key[1],
                                            "value": s.value})
            seen[key] = s.value
        self._last_values = seen

    def engine_for(self, labels: dict[str, str]) -> str:
        """The engine name of a series, from its labels."""
        return self.engine_of()

    def open_rows(self, now_ns: int) -> list[dict]:
        """Each engine's open window up to its last scrape (not now: what came after that
        scrape is not known yet). Read from the recorder's thread while poll() runs; taking
        the values in one C-level list() is atomic under the GIL."""
        rows = (track.open_row() for track in list(self._tracks.values()))
        return [row for row in rows if row is not None]

    def last_poll(self) -> None:
        # One more scrape as the session ends (unless the engine is in a failure's back-off):
        # what the engine counted since the last one is in the session, not up to a gap lost.
        self.poll()

    def close(self, end_ns: int) -> None:
        # A held busy span has no verdict yet; windows end at the last scrape that saw them.
        self._end_all(end_ns)
        self._tracks.clear()


def _delta(delta: dict[str, float], key: str) -> int:
    return round(delta.get(key, 0.0))


# -- vLLM -------------------------------------------------------------------------------------

_VLLM_COUNTERS = {
    "vllm:prompt_tokens_total": "prompt",
    "vllm:generation_tokens_total": "generation",
    "vllm:time_to_first_token_seconds_count": "first_tokens",
    "vllm:time_to_first_token_seconds_sum": "first_token_s",
    "vllm:inter_token_latency_seconds_sum": "inter_token_s",
    "vllm:request_success_total": "finished",
    "vllm:request_decode_time_seconds_sum": "decode_s",
}


class VllmMetrics(MetricsSource):
    """vLLM (V1) /metrics: prompt and generation token counters per (model_name, engine)."""

    name = "vllm-metrics"
    kind = "vllm"
    default_url = "http://127.0.0.1:8000/metrics"
    # (cache_config_info: its labels say the KV cache's bytes and tokens, so its bytes a token)
    engine_metric_prefixes = ("vllm:kv_offload_", "vllm:simple_kv_offload_",
                              "vllm:cache_config_info")
    family_prefix = "vllm:"
    phase_series = frozenset([*_VLLM_COUNTERS, "vllm:num_requests_running"])

    def engine_for(self, labels: dict[str, str]) -> str:
        return self.engine_of(labels.get("model_name", ""), labels.get("engine", ""))

    def read(self, samples: list[Sample]) -> dict[str, Reading]:
        out: dict[str, Reading] = {}
        for s in samples:
            counter = _VLLM_COUNTERS.get(s.name)
            if counter is None and s.name != "vllm:num_requests_running":
                continue
            r = out.setdefault(self.engine_for(s.labels), Reading())
            if counter is None:
                r.busy = bool(r.busy) or s.value > 0
                r.running = (r.running or 0) + int(s.value)
            else:
                r.counters[counter] = r.counters.get(counter, 0.0) + s.value
        # The TTFT count alone says nothing about phases.
        return {k: r for k, r in out.items()
                if "prompt" in r.counters or "generation" in r.counters}

    def split(self, delta: dict[str, float], before: Reading, now: Reading,
              interval_s: float) -> Step:
        firsts = _delta(delta, "first_tokens")
        decode = max(0, _delta(delta, "generation") - firsts)
        prefill = _delta(delta, "prompt")
        finished = _delta(delta, "finished")
        decode_s = delta.get("decode_s", 0.0)
        if not (prefill and firsts and "first_token_s" in now.counters):
            # One request finished and none runs: where its decode ended is known.
            idle = finished == 1 and now.running == 0 and decode_s >= 0
            steps_s = max(0.0, delta.get("inter_token_s", 0.0))
            return Step(prefill, decode, busy=bool(now.busy), ended=Ended(
                int(decode_s * 1e9), int(steps_s * 1e9)) if idle else None)
        # How long the prefills that completed here ran: one request's time to first token;
        # several ran one after another (their sum) unless batched together, and cannot
        # have begun before the interval by more than the mean. After them came the decode
        # time per running request (one stream's steps follow each other).
        first_s = max(0.0, delta.get("first_token_s", 0.0))
        prefill_s = min(first_s, interval_s + first_s / firsts)
        # Requests that ran at the last scrape and did not finish since went on decoding
        # beside these prefills: the engine batched them together (mixed).
        streams = max(1, now.running or 1)
        return Step(prefill, decode, busy=bool(now.busy), carve=Carve(
            prefill_ns=int(prefill_s * 1e9),
            after_ns=int(max(0.0, delta.get("inter_token_s", 0.0)) / streams * 1e9),
            beside=(before.running or 0) - finished > 0,
            # (Only a request running at the last scrape can be the one before these: with
            # none running then, the one that finished is one of these.)
            finished_decode_ns=int(decode_s * 1e9) if finished == 1 and decode_s >= 0
            and (before.running or 0) >= 1 else None))


# -- SGLang ------------------------------------------------------------------------------------

_SGLANG_REALTIME = {"prefill_compute": "rt_prefill", "prefill_cache": "rt_prefill",
                    "decode": "rt_decode"}
_SGLANG_REQUEST = {"sglang:prompt_tokens_total": "req_prompt",
                   "sglang:generation_tokens_total": "req_generation"}
# Labels that tell apart schedulers working on the same batches.
_SGLANG_REPLICA = ("tp_rank", "pp_rank", "moe_ep_rank", "engine_type")
FALLBACK_CONFIDENCE = 0.25


class SglangMetrics(MetricsSource):
    """SGLang /metrics (--enable-metrics): realtime token counters per dp_rank."""

    name = "sglang-metrics"
    kind = "sglang"
    default_url = "http://127.0.0.1:30000/metrics"
    engine_metric_prefixes = ("sglang:hicache_", "sglang:load_back_",
                              "sglang:prefetched_tokens", "sglang:backuped_tokens",
                              "sglang:storage_")
    phase_series = frozenset(["sglang:realtime_tokens_total", *_SGLANG_REQUEST])
    family_prefix = "sglang:"
    lazy_series = True

    def engine_for(self, labels: dict[str, str]) -> str:
        return self.engine_of(labels.get("model_name", ""), labels.get("dp_rank", ""))

    def read(self, samples: list[Sample]) -> dict[str, Reading]:
        # engine -> replica -> counter -> total; summed within a scheduler, max across them.
        per: dict[str, dict[tuple, dict[str, float]]] = {}
        for s in samples:
            if s.name == "sglang:realtime_tokens_total":
                counter = _SGLANG_REALTIME.get(s.labels.get("mode", ""))
            else:
                counter = _SGLANG_REQUEST.get(s.name)
            if counter is None:
                continue
            replica = tuple(s.labels.get(k, "") for k in _SGLANG_REPLICA)
            totals = per.setdefault(self.engine_for(s.labels), {}).setdefault(replica, {})
            totals[counter] = totals.get(counter, 0.0) + s.value
        out = {}
        for engine, replicas in per.items():
            r = Reading()
            for totals in replicas.values():
                for k, v in totals.items():
                    r.counters[k] = max(r.counters.get(k, 0.0), v)
            out[engine] = r
        return out

    def split(self, delta: dict[str, float], before: Reading, now: Reading,
              interval_s: float) -> Step:
        if "rt_prefill" in now.counters or "rt_decode" in now.counters:
            return Step(_delta(delta, "rt_prefill"), _delta(delta, "rt_decode"))
        return Step(_delta(delta, "req_prompt"), _delta(delta, "req_generation"),
                    confidence=FALLBACK_CONFIDENCE)


# -- TGI -----------------------------------------------------------------------------------------

_TGI_CALLS = {"tgi_batch_forward_duration_count": "forward",
              "tgi_batch_inference_count": "inference",
              "tgi_batch_inference_count_total": "inference"}


class TgiMetrics(MetricsSource):
    """Text Generation Inference /metrics: batch calls by method (prefill, decode)."""

    name = "tgi-metrics"
    kind = "tgi"
    default_url = "http://127.0.0.1:9000/metrics"
    counts_are_tokens = False
    phase_series = frozenset([*_TGI_CALLS, "tgi_batch_current_size"])
    family_prefix = "tgi_"
    lazy_series = True

    def engine_of(self, model: str = "", rank: str = "") -> str:
        return self.engine_override or f"tgi:{urllib.parse.urlsplit(self.url).netloc}"

    def read(self, samples: list[Sample]) -> dict[str, Reading]:
        r = Reading()
        for s in samples:
            if s.name == "tgi_batch_current_size":
                r.busy = bool(r.busy) or s.value > 0
                continue
            which = _TGI_CALLS.get(s.name)
            method = s.labels.get("method")
            if which is None or method not in ("prefill", "decode"):
                continue
            key = f"{which}_{method}"
            r.counters[key] = r.counters.get(key, 0.0) + s.value
        return {self.engine_of(): r} if r.counters else {}

    def split(self, delta: dict[str, float], before: Reading, now: Reading,
              interval_s: float) -> Step:
        # The forward timings are the per-call record; the inference counter is the older
        # and coarser one, used only where the exporter has no forward histogram.
        which = "forward" if any(k.startswith("forward_") for k in now.counters) else "inference"
        return Step(_delta(delta, f"{which}_prefill"), _delta(delta, f"{which}_decode"),
                    busy=bool(now.busy))


SOURCES: dict[str, type[MetricsSource]] = {
    VllmMetrics.name: VllmMetrics, SglangMetrics.name: SglangMetrics, TgiMetrics.name: TgiMetrics}


def from_spec(spec: str, engine: str | None = None) -> MetricsSource:
    """A source from `--phases` syntax: `vllm-metrics`, or `vllm-metrics=URL`."""
    kind, _, url = spec.partition("=")
    cls = SOURCES.get(kind.strip())
    if cls is None:
        raise KvprofError(f"unknown metrics source {kind!r}; choose from "
                          f"{', '.join(SOURCES)}", EX_USAGE)
    return cls(url.strip() or None, engine=engine)
