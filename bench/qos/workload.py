"""The workload: llm-d's mixed-priority shape, scaled to one llama-server on a 2-core box.

llm-d-batch-gateway's run (docs/performance.md, "Mixed priorities on a real engine"):
interactive ISL 512 / OSL 128 in bursts of 15 req/s (90 s on, 90 s off at 1 req/s) beside
3 x 1,000 batch jobs, batch OSL lognormal (mean 500, sd 400, max 2,048). Here, on an
engine that generates ~200 tokens/s in all:

* interactive: 64-token prompts, 16-token outputs, on/off phases (``on_secs`` at
  ``interactive_rps``, then ``off_secs`` at a fifteenth of it), exponential gaps;
* bulk: 64-token prompts, outputs lognormal (mean 64, sd 48, clipped to 8..256 tokens);
  a standing backlog of ``backlog`` requests at the window's start, then exponential
  gaps at ``bulk_rps`` (above what the engine serves, so bulk always waits);
* open loop: every arrival time is drawn before the run from the round's seed, so each
  scenario of a round gets the same requests at the same instants.

The model's vocabulary is bytes, so a prompt of N ASCII characters is N tokens (plus
the chat template's), and a logit bias keeps the output to ASCII: every token is one
SSE event, which is what lets the client measure inter-token latency per token.
"""

from __future__ import annotations

import json
import math
import random
import string
from dataclasses import asdict, dataclass

INTERACTIVE = "interactive"
BULK = "bulk"
CLASSES = (INTERACTIVE, BULK)

# Tokens the sampler may not pick: <unk>, <s>, </s> (empty text) and the bytes >= 0x80
# (a byte-level vocabulary: token 3 + b is byte b; a non-ASCII byte alone is not valid
# UTF-8, so the server would hold it back and send it merged with the next token).
BANNED_TOKENS = (0, 1, 2, *range(3 + 0x80, 3 + 0x100))
_PROMPT_ALPHABET = string.ascii_lowercase + "      "


@dataclass(frozen=True)
class Workload:
    """What the load client sends in one scenario's window (seconds, requests/s, tokens)."""

    seconds: float = 60.0
    on_secs: float = 10.0
    off_secs: float = 10.0
    interactive_rps: float = 2.4  # during an on phase; a fifteenth of it while off
    interactive_prompt: int = 64
    interactive_tokens: int = 16
    bulk_rps: float = 3.6
    backlog: int = 8
    bulk_prompt: int = 64
    bulk_mean: float = 64.0
    bulk_sd: float = 48.0
    bulk_min: int = 8
    bulk_max: int = 256
    # The client gives up on a request this long after sending it.
    interactive_timeout: float = 30.0
    bulk_timeout: float = 60.0

    @property
    def off_rps(self) -> float:
        return self.interactive_rps / 15.0  # llm-d: 15 req/s on, 1 req/s off

    def phase_on(self, t: float) -> bool:
        return (t % (self.on_secs + self.off_secs)) < self.on_secs

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the window opens
    cls: str
    prompt: int  # characters = tokens
    tokens: int  # max_tokens, generated in full (EOS ignored)
    seed: int  # of the prompt's text


def bulk_tokens(rng: random.Random, w: Workload) -> int:
    """Lognormal with the workload's mean and sd, clipped to [bulk_min, bulk_max]."""
    sigma2 = math.log(1.0 + (w.bulk_sd / w.bulk_mean) ** 2)
    mu = math.log(w.bulk_mean) - sigma2 / 2.0
    return int(min(w.bulk_max, max(w.bulk_min, round(rng.lognormvariate(mu, sigma2 ** 0.5)))))


def schedule(w: Workload, seed: int, *, bulk: bool = True) -> list[Request]:
    """The round's requests in time order. Each class draws from a generator of its own,
    so leaving bulk out (the interactive-alone baseline) leaves interactive unchanged."""
    out: list[Request] = []
    rng = random.Random(f"{seed}/interactive")
    start, on = 0.0, True
    while start < w.seconds:
        # Each phase draws exponential gaps at its own rate from its own start (the
        # process is memoryless, so cutting a gap at a phase boundary biases nothing).
        end = min(w.seconds, start + (w.on_secs if on else w.off_secs))
        t = start
        while (t := t + rng.expovariate(w.interactive_rps if on else w.off_rps)) < end:
            out.append(Request(t, INTERACTIVE, w.interactive_prompt, w.interactive_tokens,
                               rng.randrange(1 << 30)))
        start, on = start + (w.on_secs if on else w.off_secs), not on
    if bulk:
        rng = random.Random(f"{seed}/bulk")
        out += [Request(0.0, BULK, w.bulk_prompt, bulk_tokens(rng, w), rng.randrange(1 << 30))
                for _ in range(w.backlog)]
        t = 0.0
        while (t := t + rng.expovariate(w.bulk_rps)) < w.seconds:
            out.append(Request(t, BULK, w.bulk_prompt, bulk_tokens(rng, w),
                               rng.randrange(1 << 30)))
    out.sort(key=lambda r: (r.at, r.cls))
    return out


def prompt_text(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(_PROMPT_ALPHABET) for _ in range(chars))


def body(req: Request) -> bytes:
    """A streamed chat completion generating exactly ``req.tokens`` ASCII tokens. No
    prompt cache: every request is a new user's prompt, prefilled in full."""
    return json.dumps({
        "model": "qos", "stream": True, "max_tokens": req.tokens, "ignore_eos": True,
        "temperature": 1.0, "cache_prompt": False,
        "logit_bias": [[t, False] for t in BANNED_TOKENS],
        "messages": [{"role": "user", "content": prompt_text(req.prompt, req.seed)}],
    }, separators=(",", ":")).encode()
