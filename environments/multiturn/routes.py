"""The experts an MoE model routed each position of a multi-turn row to, for the trainer's routing
replay (--routing-replay), each taken from the turn's own /generate call.

A /generate call run with --enable-return-routed-experts returns, per completion, the experts of
its whole prompt + completion but the last token (`RoutedExperts`: one row per position, the last
sampled token was never fed forward). A multi-turn row sends the row so far as each turn's prompt,
so every call covers the earlier turns again. `RowRoutes` keeps, per position, the routes of the
first call that fed it forward: the call that sampled the turn (its tokens, and the context right
before them, whose last position produced the turn's first logprob). A later call that read those
positions from vLLM's prefix cache reports the same routes; one that computed them again (the
cache evicted, the weights moved in shared_vllm) may report others, and taking them would replay
an earlier turn's tokens with routes that did not sample them. Where the routes of one position
differ between calls no single row replays both turns exactly; the row keeps those of the turn
whose sampled tokens sit there.
"""

from __future__ import annotations

import base64
from typing import Optional

import numpy as np

from environments.schemas import RoutedExperts

WIRE_DTYPES = {"uint8": np.uint8, "uint16": np.uint16}


def decode_routes(routes: RoutedExperts) -> np.ndarray:
    """(positions, layers, top_k) uint16 expert ids of one completion's `routed_experts`."""
    if routes.dtype not in WIRE_DTYPES:
        raise ValueError(f"routed_experts dtype {routes.dtype!r} is unknown; valid: {', '.join(WIRE_DTYPES)}")
    raw = np.frombuffer(base64.b64decode(routes.data), dtype=np.dtype(WIRE_DTYPES[routes.dtype]).newbyteorder("<"))
    width = routes.layers * routes.top_k
    if width == 0 or raw.size % width:
        raise ValueError(f"routed_experts holds {raw.size} ids, not a whole number of positions of "
                         f"{routes.layers} layers x top_k {routes.top_k}")
    return raw.astype(np.uint16).reshape(-1, routes.layers, routes.top_k)


def encode_routes(array: np.ndarray) -> RoutedExperts:
    """`array` (positions, layers, top_k) as /generate sends routes: the narrowest dtype that holds it."""
    dtype = "uint8" if int(array.max(initial=0)) < 256 else "uint16"
    data = np.ascontiguousarray(array, dtype=np.dtype(WIRE_DTYPES[dtype]).newbyteorder("<"))
    return RoutedExperts(layers=int(array.shape[1]), top_k=int(array.shape[2]), dtype=dtype,
                         data=base64.b64encode(data.tobytes()).decode())


class RowRoutes:
    """The routes of one row, built call by call (see the module docstring)."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []  # (positions, layers, top_k) each, in row order
        self.positions = 0  # positions with routes so far

    def add_call(self, routes: RoutedExperts, tokens: int) -> None:
        """Take from one call's `routes` (its prompt, the row so far, plus its completion: `tokens`
        ids, so `tokens` - 1 positions) those of the positions the row has none for yet."""
        array = decode_routes(routes)
        if array.shape[0] != tokens - 1:
            raise ValueError(f"/generate returned routes of {array.shape[0]} positions for a prompt + completion of "
                             f"{tokens} tokens: expected {tokens - 1}, one per token but the last")
        if self._parts and array.shape[1:] != self._parts[0].shape[1:]:
            raise ValueError(f"/generate returned routes of {array.shape[1]} layers x top_k {array.shape[2]} after "
                             f"{self._parts[0].shape[1]} x {self._parts[0].shape[2]}: one row's turns come from one model")
        if array.shape[0] < self.positions:
            raise ValueError(f"a call's routes cover {array.shape[0]} positions, fewer than the {self.positions} "
                             "of the row before it: its prompt was not the row so far")
        self._parts.append(array[self.positions:])
        self.positions = array.shape[0]

    def wire(self, tokens: int) -> Optional[RoutedExperts]:
        """The routes of the row's first `tokens` ids (`tokens` - 1 positions) as the API takes them;
        None before any call."""
        if not self._parts:
            return None
        if tokens - 1 > self.positions:
            raise ValueError(f"a row of {tokens} tokens needs routes of {tokens - 1} positions; the calls gave "
                             f"{self.positions}")
        return encode_routes(np.concatenate(self._parts)[: tokens - 1])
