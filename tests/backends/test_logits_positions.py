"""Several logits positions per row (a speculative verify row) and the optional hidden_states output: a row with k
draft tokens gives the logits and hidden states that feeding the same tokens one at a time gives, on both attention
paths, for attention-only, hybrid and pure recurrent models; hidden_states are the named layers' outputs (the
last layer's, normed and through the head, are the logits); recurrent rows roll back; engines built before
logits_indices still decode and refuse verify calls; the TensorRT path binds the new inputs and outputs."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.ort_support import cpu_kernel_on

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import (
    EMBEDDING_FILE,
    EMBEDDING_TENSOR,
    ENGINE_MODEL_FILE,
    ENGINE_WEIGHTS_FILE,
    LEGACY_LAST_TOKEN_IDS,
    LOGITS_INDICES,
    load_engine_dir,
)
from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.manifest import ENGINE_KIND, write_manifest
from kvforge.contract.safetensors_map import map_tensor
from kvforge.graph.onnx_graph import INT64, GraphWriter, value_info
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.executor import ModelExecutor
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.runtime.execution.recurrent_state import RecurrentStates
from kvforge.runtime.step import BatchOutput, ScheduledRow
from kvforge.tools.export.cli import parse_layer_ids
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

T = 16
BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=4, tokens_per_page=T)
# Last layer first, so hidden_states[:, :H] normed and through the LM head must give the logits.
LAYERS = {"tiny-llama": [1, 0], "tiny-qwen3_5": [3, 1], "tiny-mamba2": [1, 0]}
CASES = [("tiny-llama", "onnx"), ("tiny-llama", "kernel"), ("tiny-qwen3_5", "onnx"), ("tiny-qwen3_5", "kernel"),
         ("tiny-mamba2", "onnx")]  # Mamba2 has no attention: one path
PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
SAMPLED, DRAFTS = 60, [61, 62, 63]
ATOL = 2e-4
HIDDEN, VOCAB = 64, 259  # every tiny model's


@dataclass
class _Lease:  # what ModelExecutor reads of a lease (hashable by identity, as the engine's are)
    page_ids: list[int]
    parts: dict = field(default_factory=dict)  # no sliding-window part: one page table
    __hash__ = object.__hash__


@dataclass
class _Request:
    adapter: None = None
    media: list = field(default_factory=list)
    adapter_start: int = 0  # no activated LoRA


@dataclass
class _Seq:  # the fields ModelExecutor reads of a Sequence
    tokens: list[int]
    lease: _Lease
    num_computed_tokens: int = 0
    request: _Request = field(default_factory=_Request)

    def all_token_ids(self) -> list[int]:
        return self.tokens


@dataclass
class _Model:
    runner: OrtBackend
    executor: ModelExecutor
    weights: dict[str, np.ndarray]
    name: str
    seqs: list[_Seq] = field(default_factory=list)

    def new_seq(self, tokens: list[int]) -> _Seq:
        first = 4 * len(self.seqs)  # 64 positions each; a test runs at most 4 (the batch size: state rows)
        seq = _Seq(list(tokens), _Lease(list(range(first, first + 4))))
        if self.executor.state_rows is not None:
            self.executor.state_rows[seq.lease] = self.runner.states.allocate()  # type: ignore[union-attr]
        self.seqs.append(seq)
        return seq

    def release(self) -> None:
        if self.executor.state_rows is not None:
            for seq in self.seqs:
                self.runner.states.free(self.executor.state_rows.pop(seq.lease))  # type: ignore[union-attr]
        self.seqs.clear()

    def run(self, *rows: tuple[_Seq, int, list[int]]) -> BatchOutput:
        """One ModelExecutor.run over (seq, pending tokens, drafts) rows; pending tokens then count as computed."""
        scheduled = [ScheduledRow(seq, n, n > 1, list(drafts)) for seq, n, drafts in rows]  # type: ignore[arg-type]
        out = self.executor.run(scheduled)
        for seq, n, _ in rows:
            seq.num_computed_tokens += n
        return out


def _engine(root: Path, name: str, path: str) -> Path:
    loaded = synthetic_model(name, "fp32", hidden_state_layers=LAYERS[name])
    write_onnx_dir(loaded, root / "onnx")
    build_engine(root / "onnx", root / "engine", replace(BUILD, cpu_attention=path))
    return root / "engine"


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{p}" for n, p in CASES])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> _Model:
    name, path = request.param
    if path == "kernel" and not cpu_kernel_on():
        pytest.skip("the kvforge CPU kernel is off or cannot be built here")
    engine = load_engine_dir(_engine(tmp_path_factory.mktemp(f"{name}-{path}"), name, path))
    runner = OrtBackend(engine, num_threads=2)
    embedding = map_tensor(engine.file(EMBEDDING_FILE), EMBEDDING_TENSOR)
    state_rows = {} if runner.states is not None else None
    return _Model(runner, ModelExecutor(runner, embedding, {}, state_rows), synthetic_model(name, "fp32").weights,
                  name)


@pytest.fixture
def model(built: _Model):
    """The module's engine, its sequences' state rows freed after each test."""
    yield built
    built.release()


def _one_at_a_time(model: _Model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Prefill PROMPT, then decode each of `tokens` alone: the logits and hidden states after each."""
    seq = model.new_seq(PROMPT)
    model.run((seq, len(PROMPT), []))
    logits, hidden = [], []
    for token in tokens:
        seq.tokens.append(token)
        out = model.run((seq, 1, []))
        logits.append(out.logits[0][0])
        hidden.append(out.hidden_states[0][0])  # type: ignore[index]
    return np.stack(logits), np.stack(hidden)


def test_draft_tokens_give_the_logits_of_one_token_at_a_time(model: _Model) -> None:
    expected_logits, expected_hidden = _one_at_a_time(model, [SAMPLED, *DRAFTS])
    verify, plain = model.new_seq(PROMPT), model.new_seq(PROMPT)
    model.run((verify, len(PROMPT), []), (plain, len(PROMPT), []))
    verify.tokens.append(SAMPLED)
    plain.tokens.append(SAMPLED)
    # One call: a verify row (1 pending + 3 drafts) and a plain decode row, grouped together by width.
    out = model.run((plain, 1, []), (verify, 1, DRAFTS))
    assert [a.shape for a in out.logits] == [(1, VOCAB), (1 + len(DRAFTS), VOCAB)]
    assert out.hidden_states is not None
    assert [h.shape for h in out.hidden_states] == [(1, 2 * HIDDEN), (1 + len(DRAFTS), 2 * HIDDEN)]
    np.testing.assert_allclose(out.logits[1], expected_logits, atol=ATOL)
    np.testing.assert_allclose(out.hidden_states[1], expected_hidden, atol=ATOL)
    np.testing.assert_allclose(out.logits[0], expected_logits[:1], atol=ATOL)
    np.testing.assert_allclose(out.hidden_states[0], expected_hidden[:1], atol=ATOL)


def test_hidden_states_are_the_named_layers_outputs(model: _Model) -> None:
    """The first named layer is the last one: its output, final-normed and through the head, is the logits."""
    seq = model.new_seq(PROMPT)
    model.run((seq, len(PROMPT) - 3, []))
    out = model.run((seq, 1, PROMPT[-2:]))  # the prompt's last three tokens as one pending and two drafts
    last = out.hidden_states[0][:, :HIDDEN].astype(np.float64)  # type: ignore[index]
    w = model.weights
    if model.name == "tiny-mamba2":
        norm = w["backbone.norm_f.weight"]
    elif model.name == "tiny-qwen3_5":
        norm = 1.0 + w["model.norm.weight"]  # zero-centred in the checkpoint
    else:
        norm = w["model.norm.weight"]
    eps = synthetic_model(model.name).config.rms_norm_eps
    normed = last / np.sqrt((last ** 2).mean(-1, keepdims=True) + eps) * norm
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    np.testing.assert_allclose(normed @ head.T, out.logits[0], atol=1e-3)


def test_a_recurrent_row_rolls_back_to_its_state_before_the_drafts(model: _Model) -> None:
    states = model.runner.states
    if states is None:
        pytest.skip("attention-only: rejected drafts' K/V are simply overwritten")
    expected_logits, _ = _one_at_a_time(model, [SAMPLED, *DRAFTS])
    seq = model.new_seq(PROMPT)
    model.run((seq, len(PROMPT), []))
    row = model.executor.state_rows[seq.lease]  # type: ignore[index]
    before = [s.copy() for s in states.read(row)]
    seq.tokens.append(SAMPLED)
    states.save([row])  # what the scheduler's state manager does when it schedules a row with drafts
    model.run((seq, 1, DRAFTS))
    assert states.is_saved(row) and not all(np.array_equal(a, b) for a, b in zip(before, states.read(row),
                                                                                  strict=True))
    # The commit step: two drafts rejected, so roll back and recompute the sampled token and the accepted one.
    states.rollback(row)
    assert all(np.array_equal(a, b) for a, b in zip(before, states.read(row), strict=True))
    seq.num_computed_tokens -= 1
    seq.tokens = seq.tokens[:len(PROMPT)] + [SAMPLED, DRAFTS[0]]
    out = model.run((seq, 2, []))
    np.testing.assert_allclose(out.logits[0][0], expected_logits[1], atol=ATOL)


def _states() -> RecurrentStates:
    return RecurrentStates({"conv_state_0": (3, 2), "recurrent_state_0": (2, 2, 2)}, num_rows=3)


def _fill(states: RecurrentStates, row: int, value: float) -> None:
    states.write(row, [np.full(a.shape[1:], value, np.float32) for a in states.arrays.values()])


def test_rollback_restores_the_saved_rows_only() -> None:
    states = _states()
    a, b, c = states.allocate(), states.allocate(), states.allocate()
    for row, value in ((a, 1.0), (b, 2.0), (c, 3.0)):
        _fill(states, row, value)
    states.save([a, c])
    for row in (a, b, c):
        _fill(states, row, 9.0)  # the call overwrote every row
    states.rollback(c)
    assert all((s == 3.0).all() for s in states.read(c)) and all((s == 9.0).all() for s in states.read(a))
    states.rollback(a)
    assert all((s == 1.0).all() for s in states.read(a)) and all((s == 9.0).all() for s in states.read(b))


def test_a_second_save_replaces_the_first() -> None:
    states = _states()
    row = states.allocate()
    _fill(states, row, 1.0)
    states.save([row])
    _fill(states, row, 2.0)
    states.save([row])
    _fill(states, row, 3.0)
    states.rollback(row)
    assert all((s == 2.0).all() for s in states.read(row))


def test_save_and_rollback_misuse_is_an_error() -> None:
    states = _states()
    row = states.allocate()
    with pytest.raises(AssertionError, match="no saved state"):
        states.rollback(row)
    states.save([row])
    states.rollback(row)
    with pytest.raises(AssertionError, match="no saved state"):
        states.rollback(row)  # once per save
    with pytest.raises(AssertionError, match="not allocated"):
        states.save([row + 1])
    states.save([row])
    states.free(row)
    assert not states.is_saved(row)  # the saved copy died with the row
    with pytest.raises(AssertionError, match="no saved state"):
        states.rollback(row)


# --- config and export option ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [[2], [-1], [0, 0]])
def test_hidden_state_layers_are_validated(layers: list[int]) -> None:
    with pytest.raises(InvalidConfig) as info:
        synthetic_model("tiny-llama", hidden_state_layers=layers)
    assert info.value.field == "config.hidden_state_layers"


def test_hidden_state_layers_flag_parses_a_comma_list() -> None:
    assert parse_layer_ids("") == [] and parse_layer_ids("1, 0") == [1, 0]
    with pytest.raises(KvforgeError) as info:
        parse_layer_ids("1,x")
    assert info.value.field == "--hiddenStateLayers"


def test_no_hidden_state_layers_means_no_output(tiny_engine_dir: Path) -> None:
    runner = OrtBackend(load_engine_dir(tiny_engine_dir), num_threads=2)
    embeds = np.ones((1, 3, HIDDEN), np.float32)
    out = runner.forward(StepInputs(embeds, np.array([3], np.int32), np.zeros(1, np.int32), [[0]]))
    assert out.logits.shape == (1, VOCAB) and out.hidden_states is None


# --- engine dirs built before logits_indices ------------------------------------------------------------------------

def make_legacy(model: onnx.ModelProto) -> None:
    """Turn an exported or lowered graph into one that takes last_token_ids [B], as graphs before logits_indices
    did: logits_indices becomes range(B) * S + last_token_ids inside the graph."""
    graph = model.graph
    g = GraphWriter(prefix="legacy/")
    batch, seq = (g.op("Squeeze", [g.dim("inputs_embeds", axis), g.const([0])]) for axis in (0, 1))
    rows = g.op("Range", [g.const(0), batch, g.const(1)])
    g.op("Add", [g.mul(rows, seq), LEGACY_LAST_TOKEN_IDS], outputs=[LOGITS_INDICES])
    inputs = [vi for vi in graph.input if vi.name != LOGITS_INDICES] + [
        value_info(LEGACY_LAST_TOKEN_IDS, INT64, ["batch"])]
    del graph.input[:]
    graph.input.extend(inputs)
    nodes = g.nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(g.initializers)


def legacy_copy(directory: Path, target: Path, kind: str = ENGINE_KIND) -> Path:
    """A copy of an engine (or ONNX) dir whose graph is make_legacy's, its manifest rewritten."""
    shutil.copytree(directory, target)
    model = onnx.load(str(target / ENGINE_MODEL_FILE), load_external_data=False)
    make_legacy(model)
    onnx.save_model(model, str(target / ENGINE_MODEL_FILE))  # keeps pointing at the copied external weights
    assert (target / ENGINE_WEIGHTS_FILE).is_file()
    write_manifest(target, kind)
    return target


def test_an_engine_from_before_logits_indices_decodes_and_refuses_verify_calls(tiny_engine_dir: Path,
                                                                                 tmp_path: Path) -> None:
    legacy = OrtBackend(load_engine_dir(legacy_copy(tiny_engine_dir, tmp_path / "legacy")), num_threads=2)
    current = OrtBackend(load_engine_dir(tiny_engine_dir), num_threads=2)
    embeds = np.random.default_rng(0).standard_normal((2, 5, HIDDEN)).astype(np.float32)

    def step(indices: np.ndarray | None = None) -> StepInputs:
        return StepInputs(embeds, np.array([5, 3], np.int32), np.zeros(2, np.int32), [[0], [1]],
                          logits_indices=indices)

    got = legacy.forward(step()).logits
    assert got.shape == (2, VOCAB)
    np.testing.assert_allclose(got, current.forward(step()).logits, atol=1e-5)
    np.testing.assert_allclose(legacy.forward(step(np.array([4, 7]))).logits, got, atol=1e-6)  # the same positions
    with pytest.raises(KvforgeError, match="rebuild it with llm_build") as info:
        legacy.forward(step(np.array([3, 4, 7])))
    assert "\n" not in info.value.message
