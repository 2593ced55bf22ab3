"""Runs a lowered engine on ONNX Runtime (CPU): K/V rows written by the kernel in place, or scattered from outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from kvforge.contract.engine_dir import (
    ATTENTION_CPU_KERNEL,
    EMBEDDING_FILE,
    EMBEDDING_TENSOR,
    ENGINE_MODEL_FILE,
    HIDDEN_STATES,
    HIDDEN_STATES_INDICES,
    LEGACY_LAST_TOKEN_IDS,
    LOGITS_INDICES,
    TIED_HEAD_INPUT,
    TREE_MASK_INPUT,
    TREE_POSITIONS_INPUT,
    EngineDir,
    new_rows_name,
)
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import ACTIVATION_INPUT
from kvforge.contract.paging import GLOBAL_PAGE_TABLE, pages_for
from kvforge.contract.safetensors_map import map_tensor
from kvforge.contract.window_pool import page_groups
from kvforge.plugins.ops import UNUSED_PAGE
from kvforge.plugins.reference import rope_table
from kvforge.runtime.execution.backend import ForwardOutput, StepInputs, activation_values, last_token_indices
from kvforge.runtime.execution.kv_store import KVStore
from kvforge.runtime.execution.output_buffers import OutputBuffers
from kvforge.runtime.execution.recurrent_state import RecurrentStates, is_state_input
from kvforge.runtime.execution.tree_attention import start_positions

# ONNX Runtime's own log lines would break the one-line error promise: failures surface as exceptions anyway,
# so its logger is silenced (fatal only) unless a CLI runs with --debug (warnings and up).
QUIET_SEVERITY, DEBUG_SEVERITY = 4, 2
_log_severity = QUIET_SEVERITY


def set_ort_logging(debug: bool) -> None:
    global _log_severity
    _log_severity = DEBUG_SEVERITY if debug else QUIET_SEVERITY
    ort.set_default_logger_severity(_log_severity)


ort.set_default_logger_severity(QUIET_SEVERITY)
log = logging.getLogger("kvforge.runtime")


LOGITS = "logits"
MAX_THREADS = 1024  # ONNX Runtime starts every thread up front: a huge count exhausts the process


def make_session(model_path: str, num_threads: int = 0, profile_prefix: str | None = None,
                 field: str = "engine_dir", cpu_kernel: bool = False, spinning: bool = True) -> ort.InferenceSession:
    """Every ONNX Runtime session of kvforge (text and encoder engines): logging, threads, one-line load errors
    naming `field`. `profile_prefix`: write ONNX Runtime's per-node trace there (kvforge/runtime/engine/op_timing.py
    reads it).
    `cpu_kernel`: the graph attends with kvforge.cpu.PagedAttention, so the kernel library is registered.
    `spinning=False`: the intra-op threads sleep between runs instead of spinning (ONNX Runtime's default, faster
    for one session). Where two sessions alternate on the same cores (a speculative base and its EAGLE3 draft), the
    idle one's spinning threads steal the cores the other runs on: measured on 2 cores, a SmolLM2 verify call of
    3 positions took 74 ms beside a spinning draft session against 36 ms alone."""
    if not 0 <= num_threads <= MAX_THREADS:
        raise KvforgeError(f"must be in [0, {MAX_THREADS}] (0 = onnxruntime's default), got {num_threads}",
                           "num_threads")
    options = ort.SessionOptions()
    options.log_severity_level = _log_severity
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    if num_threads > 0:
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if cpu_kernel:
        register_cpu_kernel(options, field)
    try:
        return ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvforgeError(f"onnxruntime cannot load {model_path}: {first}", field) from None


def register_cpu_kernel(options: ort.SessionOptions, field: str = "engine_dir") -> None:
    """Register kvforge's CPU attention library (built on first use) on `options`, or say in one line why not."""
    from kvforge.plugins.cpu_kernel import DAMAGED, register

    reason = register(options)
    if reason:
        remedy = "" if DAMAGED in reason else "; rebuild it with llm_build --cpuAttention onnx"  # the cache's fault
        raise KvforgeError(f"this engine attends with the kvforge CPU kernel, which cannot be loaded here ({reason})"
                           f"{remedy}", field)


def check_graph_inputs(session: ort.InferenceSession, engine: EngineDir) -> None:
    """config.json against the graph: one pool input per attention layer, each shaped like the pool the runtime
    allocates, one conv and one recurrent state per recurrent layer, and embeddings of hidden_size; a mismatch
    would otherwise fail inside the first call."""
    model, build = engine.model, engine.build
    inputs = {i.name: i.shape for i in session.get_inputs()}
    pools = sorted(name for name in inputs if name.startswith("past_key_values_"))
    attention = [f"past_key_values_{i}" for i in model.pool_layer_ids]
    if sorted(attention) != pools:
        raise KvforgeError(f"config.json says num_hidden_layers {model.num_hidden_layers} with {len(attention)} "
                           f"attention layers, but the graph has {len(pools)} KV pool inputs; rebuild it with "
                           "llm_build", "engine_dir")
    recurrent = len(model.recurrent_layer_ids)
    states = [name for name in inputs if is_state_input(name)]
    if len(states) != 2 * recurrent:
        raise KvforgeError(f"config.json says {recurrent} recurrent layers but the graph has {len(states)} state "
                           "inputs (two per recurrent layer); rebuild it with llm_build", "engine_dir")
    for name in states:
        if any(not isinstance(d, int) for d in inputs[name][1:]):
            raise KvforgeError(f"graph input {name} has shape {inputs[name]}: only its batch dim may be symbolic",
                               "engine_dir")
    # A KV-shared assistant's pools are its base's: their page count is the base's (symbolic in its graph).
    pages = -1 if model.reads_base_kv else build.max_kv_pool_pages
    grouped = {}  # pool input -> its page group's pages (the global group's: `pages`)
    for group in page_groups(model, build.window_pool_pages):
        if group.table_input not in inputs:
            raise KvforgeError(f"config.json gives layers {','.join(map(str, group.layers))} the {group.name} page "
                               f"group but the graph has no {group.table_input} input; rebuild it with llm_build",
                               "engine_dir")
        grouped.update({f"past_key_values_{i}": group.pages for i in group.layers})
    for name in pools:
        expected = [grouped.get(name, pages), 2, model.num_key_value_heads,
                    build.tokens_per_page, model.layer_head_dim(int(name.rsplit("_", 1)[1]))]
        shape = inputs[name]
        if len(shape) != len(expected) or any(isinstance(d, int) and e >= 0 and d != e for d, e in zip(shape, expected,
                                                                                            strict=False)):
            raise KvforgeError(f"graph input {name} has shape {shape}, config.json implies {expected}; rebuild it "
                               "with llm_build", "engine_dir")
    logits = next((o.shape for o in session.get_outputs() if o.name == "logits"), None)
    if logits is None or (isinstance(logits[-1], int) and logits[-1] != model.logits_width):
        raise KvforgeError(f"graph output logits is {logits}, config.json says vocab_size {model.logits_width}; "
                           "rebuild it with llm_build", "engine_dir")
    if LOGITS_INDICES not in inputs and LEGACY_LAST_TOKEN_IDS not in inputs:
        raise KvforgeError(f"the graph has no {LOGITS_INDICES} input; rebuild it with llm_build", "engine_dir")
    hidden = next((o.shape for o in session.get_outputs() if o.name == HIDDEN_STATES), None)
    width = model.base_model_hidden_size if model.reads_base_kv else len(model.hidden_state_layers) * model.hidden_size
    if (hidden is None) != (width == 0) or (hidden is not None and isinstance(hidden[-1], int) and hidden[-1] != width):
        raise KvforgeError(f"graph output {HIDDEN_STATES} is {hidden}, config.json's hidden_state_layers "
                           f"{model.hidden_state_layers} imply width {width}; rebuild it with llm_build", "engine_dir")
    embeds = inputs.get("inputs_embeds")
    embeds_width = model.embedding_width
    if embeds is None or len(embeds) != 3 or (isinstance(embeds[2], int) and embeds[2] != embeds_width):
        raise KvforgeError(f"graph input inputs_embeds is {embeds}, config.json implies width {embeds_width}; "
                           "rebuild it with llm_build", "engine_dir")


def tree_positions(step: StepInputs, starts: np.ndarray) -> np.ndarray:
    """[B, S] int32 RoPE positions of a call's new tokens: the step's own, or start + i."""
    if step.position_ids is not None:
        return np.ascontiguousarray(step.position_ids, dtype=np.int32)
    return start_positions(starts, step.inputs_embeds.shape[1])


def check_last_token_positions(positions: np.ndarray, lengths: np.ndarray, width: int) -> None:
    """An engine built before logits_indices computes each row's last new token only: refuse any other ask."""
    if not np.array_equal(positions, last_token_indices(lengths, width)):
        raise KvforgeError(f"this engine was built before {LOGITS_INDICES} and returns logits at each row's last "
                           "token only (no speculative verify); rebuild it with llm_build", "engine_dir")


class OrtBackend:
    def __init__(self, engine: EngineDir, num_threads: int = 0, embedding: np.ndarray | None = None,
                 profile_prefix: str | None = None, spinning: bool = True,
                 shared_pools: dict[int, np.ndarray] | None = None) -> None:
        """`embedding`: the engine's table when the caller already has it (bound to a tied head, not mapped twice);
        `spinning`: see make_session (off for sessions that alternate with another one); `shared_pools`: for an
        engine reading another's K/V (a Gemma4 MTP assistant), that engine's pools by layer id, bound read-only."""
        model, build = engine.model, engine.build
        kernel = build.attention == ATTENTION_CPU_KERNEL
        self.session = make_session(str(engine.file(ENGINE_MODEL_FILE)), num_threads, profile_prefix,
                                    cpu_kernel=kernel, spinning=spinning)
        log.info("attention: %s", "kvforge CPU kernel (pages read in place)" if kernel
                 else "ONNX Runtime ops over pages gathered each call (the fallback)")
        check_graph_inputs(self.session, engine)
        graph_inputs = {i.name: i.shape for i in self.session.get_inputs()}
        self.tokens_per_page = build.tokens_per_page
        self.onnxruntime_ns = 0  # time inside session runs, so far: the profile's engine_call_python is the rest
        # The kernel's PagedAttentionRope writes each call's K/V rows into the bound pools itself (engine_dir.py
        # kernel_kv_write); engines built before return them as new_key_values_* for _scatter.
        self._kernel_writes = build.kernel_kv_write
        self._pool_inputs = [f"past_key_values_{i}" for i in model.attention_layer_ids]
        groups = page_groups(model, build.window_pool_pages)
        self.kv_store = KVStore(len(self._pool_inputs), build.max_kv_pool_pages, model.num_key_value_heads,
                                build.tokens_per_page, model.head_dim, model.kv_cache_dtype,
                                groups={g.name: ([k for k, i in enumerate(model.attention_layer_ids) if i in g.layers],
                                                 g.pages) for g in groups},
                                head_dims=tuple(model.layer_head_dim(i) for i in model.attention_layer_ids))
        self._group_tables = {g.name: g.table_input for g in groups}  # page group -> its table's graph input
        pools = list(self.kv_store.layers)
        if model.reads_base_kv:  # its pool inputs are the base's layers; it owns none and writes none
            if shared_pools is None or any(i not in shared_pools for i in model.pool_layer_ids):
                raise KvforgeError(f"this {model.spec_decode_type} draft reads its base's KV pools (layers "
                                   f"{model.pool_layer_ids}); load it beside its base", "engine_dir")
            self._shared_inputs = [f"past_key_values_{i}" for i in model.pool_layer_ids]
            pools = [shared_pools[i] for i in model.pool_layer_ids]
        else:
            self._shared_inputs = []
        # One state row per sequence that can run at once: the engine admits at most maxBatchSize of them.
        shapes = {name: tuple(shape[1:]) for name, shape in graph_inputs.items() if is_state_input(name)}
        self.states = RecurrentStates(shapes, build.max_batch_size) if shapes else None
        # Pools and the RoPE table are bound once as OrtValues over the numpy memory: no per-call copies.
        self._pool_values = [ort.OrtValue.ortvalue_from_numpy(layer) for layer in pools]
        self._rope_value: ort.OrtValue | None = None
        if "rope_rotary_cos_sin" in graph_inputs:
            self.rope = rope_table(build.max_kv_cache_capacity, model.rotary_dim, model.rope_theta)
            self._rope_value = ort.OrtValue.ortvalue_from_numpy(self.rope)
        self._output_names = [o.name for o in self.session.get_outputs()]
        self._hidden_indices = HIDDEN_STATES_INDICES in graph_inputs
        self.tree_attention = TREE_MASK_INPUT in graph_inputs  # tree drafting's masked calls (engine_dir.py)
        # Engine dirs built before logits_indices keep running (cheaply: their graph takes last_token_ids [B]) for
        # calls that want each row's last token only; a verify call on one is refused with "rebuild".
        self._legacy_last_token = LEGACY_LAST_TOKEN_IDS in graph_inputs
        self._lora_names = [i.name for i in self.session.get_inputs() if i.name.startswith("lora_")]
        self._activation_input = ACTIVATION_INPUT in graph_inputs
        self._lora_shapes = {i.name: (i.shape[1], i.shape[2]) for i in self.session.get_inputs()
                             if i.name.startswith("lora_")}
        self._no_adapter: dict[int, dict[str, np.ndarray]] = {}
        self._tied_head: ort.OrtValue | None = None
        if TIED_HEAD_INPUT in graph_inputs:
            table = embedding if embedding is not None else map_tensor(engine.file(EMBEDDING_FILE), EMBEDDING_TENSOR)
            self._tied_head = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(table, dtype=np.float32))
        # One binding for the backend's life: the pools, the RoPE table and the tied head are bound once (each bind
        # of an OrtValue is validated against the session: ~50 us, 30 of them a step on SmolLM2); a call rebinds
        # only what changes. Bound inputs persist across runs, and every other graph input is bound by each call.
        self._binding = self.session.io_binding()
        for name, value in zip(self._pool_inputs or self._shared_inputs, self._pool_values, strict=True):
            self._binding.bind_ortvalue_input(name, value)
        if self._rope_value is not None:
            self._binding.bind_ortvalue_input("rope_rotary_cos_sin", self._rope_value)
        if self._tied_head is not None:
            self._binding.bind_ortvalue_input(TIED_HEAD_INPUT, self._tied_head)
        # Logits (and hidden states) go straight into arrays kept across calls; None: an output of another form
        # (recurrent states, legacy new_key_values) makes every call bind its outputs afresh and copy them out.
        self.output_buffers = OutputBuffers.for_session(self.session, (LOGITS, HIDDEN_STATES))

    def forward(self, step: StepInputs) -> ForwardOutput:
        starts = step.kvcache_start_index.astype(np.int32)
        lengths = step.context_lengths.astype(np.int32)
        binding = self._binding
        binding.bind_cpu_input("inputs_embeds", np.ascontiguousarray(step.inputs_embeds, dtype=np.float32))
        binding.bind_cpu_input("context_lengths", lengths)
        positions = step.positions()
        if self._legacy_last_token:
            check_last_token_positions(positions, lengths, step.inputs_embeds.shape[1])
            binding.bind_cpu_input(LEGACY_LAST_TOKEN_IDS, (lengths - 1).astype(np.int64))
        else:
            binding.bind_cpu_input(LOGITS_INDICES, np.ascontiguousarray(positions))
        hidden_rows = len(positions)
        if self._hidden_indices:
            hidden = step.hidden_positions()
            hidden_rows = len(hidden)
            binding.bind_cpu_input(HIDDEN_STATES_INDICES, hidden)
        for name, value in (step.extra_inputs or {}).items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value, dtype=np.float32))
        if self.tree_attention:
            binding.bind_cpu_input(TREE_POSITIONS_INPUT, tree_positions(step, starts))
            mask = step.attention_mask if step.attention_mask is not None else np.zeros((len(lengths), 0, 0), bool)
            binding.bind_cpu_input(TREE_MASK_INPUT, np.ascontiguousarray(mask, dtype=bool))
        elif step.attention_mask is not None or step.position_ids is not None:
            raise AssertionError("a tree call on an engine built without tree attention")
        if self._rope_value is not None:  # graphs with attention layers
            binding.bind_cpu_input("kvcache_start_index", starts)
            extent = starts + lengths if self._kernel_writes else starts  # the pages the graph writes, too
            binding.bind_cpu_input(GLOBAL_PAGE_TABLE, self._page_table(step.page_ids, extent))
            for group, table_input in self._group_tables.items():
                if group not in step.page_tables:
                    raise AssertionError(f"a call on an engine with a {group} page group without the rows' tables")
                binding.bind_cpu_input(table_input, self._page_table(step.page_tables[group], extent))
        lora = step.lora_tensors if step.lora_tensors is not None else self._rank_zero(len(lengths))
        activation = activation_values(step.adapter_start, len(lengths), self._activation_input)
        if activation is not None:
            binding.bind_cpu_input(ACTIVATION_INPUT, activation)
        for name in self._lora_names:
            binding.bind_cpu_input(name, lora[name])
        if self.states is not None:
            if step.state_rows is None or len(step.state_rows) != len(lengths):
                raise AssertionError("a recurrent engine call needs one state row per row")
            for name, value in self.states.gather(step.state_rows).items():
                binding.bind_cpu_input(name, value)
        buffers = self.output_buffers
        if buffers is not None:
            outputs = buffers.arrays(binding, {LOGITS: len(positions), HIDDEN_STATES: hidden_rows})
        else:
            for name in self._output_names:
                binding.bind_output(name, "cpu")
        started = time.perf_counter_ns()
        self.session.run_with_iobinding(binding)
        self.onnxruntime_ns += time.perf_counter_ns() - started
        if buffers is None:
            outputs = dict(zip(self._output_names, binding.copy_outputs_to_cpu(), strict=True))
        if self._pool_inputs and not self._kernel_writes:
            self._scatter([outputs[new_rows_name(name)] for name in self._pool_inputs], step.page_ids, starts,
                          lengths, step.page_tables)
        if self.states is not None:
            self.states.scatter(step.state_rows, outputs)  # type: ignore[arg-type]
        return ForwardOutput(outputs[LOGITS], outputs.get(HIDDEN_STATES))

    def _rank_zero(self, batch: int) -> dict[str, np.ndarray]:
        """Rank-0 LoRA inputs for a call without adapters: (x @ [B, in, 0]) @ [B, 0, out] adds exact zeros."""
        if batch not in self._no_adapter:
            self._no_adapter[batch] = {
                name: np.zeros((batch, rows, 0) if name.startswith("lora_A") else (batch, 0, cols), dtype=np.float32)
                for name, (rows, cols) in self._lora_shapes.items()}
        return self._no_adapter[batch]

    def _page_table(self, page_ids: list[list[int]], extent: np.ndarray) -> np.ndarray:
        """[B, P] covering positions [0, extent[b]): the cached ones where the graph only reads the pool (the
        new pages stay out of it), through the new ones where the kernel writes them."""
        width = pages_for(int(extent.max(initial=0)), self.tokens_per_page)
        table = np.full((len(page_ids), width), UNUSED_PAGE, dtype=np.int32)
        for row, pages in enumerate(page_ids):
            used = pages[:width]
            table[row, :len(used)] = used
        return table

    def _scatter(self, new_rows: list[np.ndarray], page_ids: list[list[int]], starts: np.ndarray,
                 lengths: np.ndarray, page_tables: Mapping[str, list[list[int]]] | None = None) -> None:
        """Write each layer's new rows through its page group's tables (the global group's: `page_ids`)."""
        targets = {None: self._targets(page_ids, starts, lengths)}
        for layer, new in enumerate(new_rows):
            group = self.kv_store.layer_group[layer]
            if group not in targets:
                assert page_tables and group in page_tables, f"a {group} page group layer needs the rows' tables"
                targets[group] = self._targets(page_tables[group], starts, lengths)
            rows, tokens, pages, slots = targets[group]
            self.kv_store.scatter(layer, new[rows, tokens], pages, slots)

    def _targets(self, page_ids: list[list[int]], starts: np.ndarray,
                 lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(row, token, page, slot) of every new token of the call through the rows' tables."""
        rows, tokens, pages, slots = [], [], [], []
        for b, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            row_pages, row_slots = self.kv_store.locate(page_ids[b], start, start + length)
            rows.append(np.full(length, b))
            tokens.append(np.arange(length))
            pages.append(row_pages)
            slots.append(row_slots)
        return np.concatenate(rows), np.concatenate(tokens), np.concatenate(pages), np.concatenate(slots)
