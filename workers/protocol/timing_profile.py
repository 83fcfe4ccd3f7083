"""A measured timing profile of one engine on one machine: what ``tandem profile`` writes, what the
timing-model worker (``tandem serve --sim``) and ``tandem plan`` predict with.

    profile = TimingProfile.load("deploy/profiles/cpu-2core-smollm2.json")
    profile.prefill_s(new_tokens=256, context_tokens=512)    # one step computing 256 prompt tokens
    profile.decode_step_s(batch=8, mean_context=300)         # one step of 8 decoding requests
    profile.transfer_s(num_bytes=12 << 20)                   # one KV transfer

Each figure is a measured grid, read by (bi)linear interpolation and carried on linearly past its edges
(a step of more tokens than measured costs what the last two points' slope says). The grids are
small on purpose: a profile takes minutes, not the hours of a dense sweep.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Curve(_Strict):
    """y(x) at measured points, linear between them and past the ends (never below zero)."""

    xs: list[float] = Field(min_length=1)
    ys: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _shape(self) -> Curve:
        if len(self.xs) != len(self.ys):
            raise ValueError(f"xs has {len(self.xs)} points, ys {len(self.ys)}")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:], strict=False)):
            raise ValueError("xs must increase")
        return self

    def at(self, x: float) -> float:
        return max(0.0, _interpolate(self.xs, self.ys, x))


class Grid(_Strict):
    """z(x, y) on a grid: ``zs[i][j]`` at ``(xs[i], ys[j])``; bilinear, linear past the edges."""

    xs: list[float] = Field(min_length=1)
    ys: list[float] = Field(min_length=1)
    zs: list[list[float]]

    @model_validator(mode="after")
    def _shape(self) -> Grid:
        if len(self.zs) != len(self.xs) or any(len(row) != len(self.ys) for row in self.zs):
            raise ValueError(f"zs must be {len(self.xs)} rows of {len(self.ys)}")
        for name, axis in (("xs", self.xs), ("ys", self.ys)):
            if any(b <= a for a, b in zip(axis, axis[1:], strict=False)):
                raise ValueError(f"{name} must increase")
        return self

    def at(self, x: float, y: float) -> float:
        along_y = [_interpolate(self.ys, row, y) for row in self.zs]
        return max(0.0, _interpolate(self.xs, along_y, x))


class TimingProfile(_Strict):
    version: int = PROFILE_VERSION
    device: str  # what was measured: "cpu: 2 cores (AVX2)", "cuda: NVIDIA H100 80GB HBM3"
    model: str
    weight_format: str
    kv_bytes_per_token: int = Field(gt=0)  # the real model's K and V over all layers, one token
    block_size: int = Field(gt=0)
    kv_tokens_per_worker: int = Field(gt=0)  # one worker's KV pool, in tokens, as profiled
    max_num_seqs: int = Field(gt=0)
    prefill_chunk_size: int | None = None
    # One engine step that computes x new prompt tokens of one request after y tokens already in its
    # cache (a prefix hit or earlier chunks), sampling its first token: seconds.
    prefill: Grid
    # One engine step of x requests decoding one token each, at a mean context of y tokens: seconds.
    decode: Grid
    # One KV transfer of x bytes between two workers (the backend profiled): seconds.
    transfer: Curve
    transfer_backend: str = "tcp"
    seconds_to_measure: float = 0.0

    @property
    def device_type(self) -> str:
        """The measured machine's ``torch.device`` type: the first word of ``device`` (``cpu``, ``cuda``)."""
        return self.device.split(":", 1)[0].strip()

    @classmethod
    def load(cls, path: str | Path) -> TimingProfile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ProfileError(f"{path}: cannot read: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not JSON: {e}") from None
        try:
            profile = cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise ProfileError(f"{path}: {where}: {first['msg']}") from None
        if profile.version != PROFILE_VERSION:
            raise ProfileError(f"{path}: version {profile.version}; this Tandem reads version {PROFILE_VERSION}")
        return profile

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1) + "\n", encoding="utf-8")

    # ---- predictions ----
    def prefill_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        return self.prefill.at(new_tokens, context_tokens)

    def decode_step_s(self, batch: int, mean_context: float) -> float:
        return self.decode.at(batch, mean_context) if batch > 0 else 0.0

    def step_s(self, decode_contexts: list[int], prefill_chunks: list[tuple[int, int]]) -> float:
        """One engine step: ``decode_contexts`` (each decoding request's tokens in cache) and ``prefill_chunks``
        ((new tokens, tokens before them) each). The parts add up: a mixed step costs its decode step plus
        its prompt chunks (near the truth on a CPU, which is compute-bound either way; pessimistic on a GPU,
        where a few decode rows ride along a prompt chunk almost free)."""
        seconds = 0.0
        if decode_contexts:
            seconds += self.decode_step_s(len(decode_contexts), sum(decode_contexts) / len(decode_contexts))
        return seconds + sum(self.prefill_s(n, c) for n, c in prefill_chunks)

    def transfer_s(self, num_bytes: int) -> float:
        return self.transfer.at(num_bytes)

    def transfer_tokens_s(self, num_tokens: int) -> float:
        return self.transfer_s(num_tokens * self.kv_bytes_per_token)


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)  # the segment, or the end one past an edge
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
