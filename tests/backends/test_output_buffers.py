"""Outputs bound once (kvforge/runtime/execution/output_buffers.py): decode steps allocate and bind no output, the
answers equal those of per-call outputs, and an array a caller still holds is never written over."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.ort_support import cpu_kernel_on

from kvforge.contract.engine_dir import load_engine_dir
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams

# The pure-ONNX fallback returns each call's K/V rows as new_key_values_* outputs, whose shapes follow the call's:
# those engines keep ONNX Runtime's own output allocation (OutputBuffers.for_session is None).
pytestmark = pytest.mark.skipif(not cpu_kernel_on(), reason="outputs bound once need the kernel's logits-only graph")

PROMPT = list(range(3, 40))


def _greedy(engine: Engine, steps: int) -> list[int]:
    no_eos = {token: -100.0 for token in engine.engine_dir.model.eos_token_ids}  # every step a decode step
    engine.add_request(EngineRequest(PROMPT, SamplingParams(temperature=0.0, max_generate_length=steps,
                                                            logit_bias=no_eos)))
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens = list(output.token_ids)
    return tokens


def test_decode_steps_allocate_no_outputs_and_answer_alike(tiny_engine_dir: Path) -> None:
    engine = Engine(tiny_engine_dir, EngineConfig(num_threads=1))
    buffers = engine.backend.output_buffers
    assert buffers is not None and list(buffers.trailing) == ["logits"]
    tokens = _greedy(engine, 24)
    # the prefill call's logits row and the decode rows have one shape: one array for the whole request, bound once
    assert buffers.allocations == 1
    reference = Engine(tiny_engine_dir, EngineConfig(num_threads=1))
    reference.backend.output_buffers = None  # each call binds its outputs afresh and copies them out, as before
    assert _greedy(reference, 24) == tokens and len(tokens) == 24


def test_a_held_output_is_never_written_over(tiny_engine_dir: Path) -> None:
    engine_dir = load_engine_dir(tiny_engine_dir)
    backend = OrtBackend(engine_dir, num_threads=1)
    embedding = np.random.default_rng(0).standard_normal((8, engine_dir.model.embedding_width)).astype(np.float32)
    pages = [[0, 1]]

    def call(token: int, position: int) -> np.ndarray:
        return backend.forward(StepInputs(embedding[[token]][None], np.array([1], np.int32),
                                          np.array([position], np.int32), pages)).logits

    first = call(1, 0)
    kept = first.copy()
    second = call(2, 1)  # same shape, but `first` is still held: a new array
    assert second is not first and np.array_equal(first, kept) and not np.array_equal(first, second)
    view = second[0, :4]  # a view keeps its base held too
    third = call(3, 2)
    assert third is not second and view.base is second
    address = third.ctypes.data
    del first, second, view, third
    before = backend.output_buffers.allocations
    fourth = call(4, 3)  # nothing holds the last array: written in place, not bound again
    assert fourth.ctypes.data == address
    del fourth
    fifth = call(5, 4)
    assert backend.output_buffers.allocations == before and fifth.ctypes.data == address
