"""Deliberate faults the test suite must kill (run by ``tests/mutants/run.py``).

Each mutant is one realistic bug in one file: the exact source snippet ``old`` (it must occur exactly once
in ``file``, or the mutant is stale and the runner fails saying so) is replaced by ``new``. ``tests`` are
the pytest node ids (and ``k`` an optional ``-k`` expression) that must fail on the mutated tree: a cheap
selection of the fastest tests that kill it, not the whole suite. A mutant that the selection does not
kill is a missing test, never a reason to weaken the mutant.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    fault: str  # one line: what is wrong in the mutated code
    file: str  # relative to the repository root
    old: str  # exact snippet, must occur exactly once in ``file``
    new: str  # its replacement
    tests: tuple[str, ...]  # pytest node ids (or files) that must fail
    k: str | None = None  # optional ``-k`` expression narrowing ``tests``


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="verify_skips_users_of_new_values",
        fault="the manager's verification runs again the nodes a pass touched but not the users of a new value",
        file="hcpasses/verify.py",
        old="""        changed.update(user for node in new_values for user in node.users)
""",
        new="""        del new_values  # "users read the same node, so they need no check"
""",
        tests=("tests/test_manager.py::test_verification_reruns_only_what_a_pass_touched",),
    ),
    Mutant(
        name="fusion_reports_but_restores",
        fault="the fusion pass counts and reports its matches, then puts the graph back as it was (nothing fused)",
        file="hcpasses/passes/gated_mean_quant.py",
        old="""        by_pattern = self._fuser.apply(graph)
        collapses = self._finder.find(graph)
        lookalikes = self._finder.lookalike_note()
        left = [c for c in collapses if c.root.target not in (FUSED_GATED_MEAN, FUSED_WEIGHTED_SUM)]
        started = time.perf_counter()
        judged = {c.root: _quant_by_evaluation(c) for c in left if c.refusal is None}
        evaluation_ms = (time.perf_counter() - started) * 1e3
        evaluated = [match for match in judged.values() if isinstance(match, QuantMatch)]
        for collapse in left:
            if isinstance(judged.get(collapse.root), QuantMatch):
                fuse_matched_quant(graph, collapse, judged[collapse.root])
        fused = by_pattern + len(evaluated)
""",
        new="""        from hcpasses.verify import graph_state, restore_graph

        state = graph_state(graph)
        by_pattern = self._fuser.apply(graph)
        collapses = self._finder.find(graph)
        lookalikes = self._finder.lookalike_note()
        left = [c for c in collapses if c.root.target not in (FUSED_GATED_MEAN, FUSED_WEIGHTED_SUM)]
        started = time.perf_counter()
        judged = {c.root: _quant_by_evaluation(c) for c in left if c.refusal is None}
        evaluation_ms = (time.perf_counter() - started) * 1e3
        evaluated = [match for match in judged.values() if isinstance(match, QuantMatch)]
        for collapse in left:
            if isinstance(judged.get(collapse.root), QuantMatch):
                fuse_matched_quant(graph, collapse, judged[collapse.root])
        fused = by_pattern + len(evaluated)
        restore_graph(graph, state)  # a dry run left in: the matches are counted, the rewrite undone
""",
        tests=(
            "tests/test_mutant_killers.py::test_fused_op_is_in_the_graph_and_the_graph_computes_the_op",
            "tests/test_mtp_sp.py::test_fused_target_and_drafter_keep_the_state_sharded[2-11-True]",
        ),
    ),
    Mutant(
        name="sp_fp8_scales_through_bf16",
        fault="the SP all-gather sends the fp32 per-token FP8 scales as bf16 (rounded before the gather)",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""            source = self.graph.call_function(aten.view.dtype, (node, torch.uint8)) if as_bytes else node
            flat = self._flatten_tokens(source, k, rest)
            gathered = self.graph.call_function(c10d.all_gather_into_tensor.default, (flat, self.tp, group))
            waited = self.graph.call_function(WAIT, (gathered,))
""",
        new="""            source = self.graph.call_function(aten.view.dtype, (node, torch.uint8)) if as_bytes else node
            scales = val.dtype == torch.float32 and val.shape[-1] == 1  # per-token scales: half the bytes as bf16
            convert = torch.ops.prims.convert_element_type.default
            if scales:
                source = self.graph.call_function(convert, (source, torch.bfloat16))
            flat = self._flatten_tokens(source, k, rest)
            gathered = self.graph.call_function(c10d.all_gather_into_tensor.default, (flat, self.tp, group))
            waited = self.graph.call_function(WAIT, (gathered,))
            if scales:
                waited = self.graph.call_function(convert, (waited, torch.float32))
""",
        tests=("tests/test_sp_rewrite.py::test_mhc_family_is_sharded_and_matches_sp_off_and_eager[2-9-True-None]",),
    ),
    Mutant(
        name="sp_gather_no_trim",
        fault="the gather after all_gather keeps the pad rows (R*tp rows instead of T)",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""            full = self.graph.call_function(aten.slice.Tensor, (rows, 0, 0, self.tokens))
""",
        new="""            full = rows
""",
        tests=("tests/test_sp_rewrite.py::test_mhc_family_is_sharded_and_matches_sp_off_and_eager[2-9-True-None]",),
    ),
    Mutant(
        name="sp_pad_not_zero",
        fault="shard_rows fills the pad rows of the last shard with ones instead of zeros",
        file="hcpasses/rows.py",
        old="""    out = flat.new_zeros((rows, *flat.shape[1:]))
""",
        new="""    out = flat.new_ones((rows, *flat.shape[1:]))
""",
        tests=("tests/test_mutant_killers.py::test_shard_rows_is_this_ranks_block_zero_padded",),
    ),
    Mutant(
        name="sp_reduce_scatter_wrong_dim",
        fault="the reduce-scatter splits the rows interleaved (rank r gets rows r, r+tp, ...) instead of in blocks",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""                padded = self._pad_rows(flat, len(shape) - k + 1)
""",
        new="""                padded = self._pad_rows(flat, len(shape) - k + 1)
                rest = shape[k:]
                blocks = self.graph.call_function(aten.reshape.default, (padded, [self.rows, self.tp, *rest]))
                swapped = self.graph.call_function(aten.transpose.int, (blocks, 0, 1))
                padded = self.graph.call_function(aten.reshape.default, (swapped, [-1, *rest]))
""",
        tests=("tests/test_sp_rewrite.py::test_mhc_family_is_sharded_and_matches_sp_off_and_eager[2-9-True-None]",),
    ),
    Mutant(
        name="quant_wrong_clamp",
        fault="the per-token quant (the fused ops' CPU reference, the models' quant and the fusion's pattern)"
        " clamps the FP8 codes to +-240 (the e4m3fnuz range) instead of +-448",
        file="hcpasses/kernels/contract.py",
        old="""    q = torch.clamp(xf / scale, -448.0, 448.0).to(FP8_DTYPE)
""",
        new="""    q = torch.clamp(xf / scale, -240.0, 240.0).to(FP8_DTYPE)
""",
        tests=("tests/test_kernels.py::test_quant_epilogue_bit_exact_with_models_fp8",),
    ),
    Mutant(
        name="shard_rows_wrong_rank",
        fault="shard_rows hands each rank the rows of the mirrored rank (tp-1-rank)",
        file="hcpasses/rows.py",
        old="""    piece = flat[rank * rows : (rank + 1) * rows]
""",
        new="""    piece = flat[(world_size - 1 - rank) * rows : (world_size - rank) * rows]
""",
        tests=(
            "tests/test_mutant_killers.py::test_shard_rows_is_this_ranks_block_zero_padded",
            "tests/test_sp_rewrite.py::test_mhc_family_is_sharded_and_matches_sp_off_and_eager[2-9-True-None]",
        ),
    ),
    Mutant(
        name="quant_of_unrounded_x",
        fault="the fused gated mean quantises its fp32 accumulator instead of x rounded to the activation dtype",
        file="hcpasses/kernels/contract.py",
        old="""    return _with_quant(_ieee_div(_fixed_order_sum(terms), n_streams).to(xn.dtype))
""",
        new="""    mean = _ieee_div(_fixed_order_sum(terms), n_streams)
    return (mean.to(xn.dtype), *quant_epilogue_reference(mean))
""",
        tests=("tests/test_kernels.py::test_op_matches_contract_formula_and_models_quant",),
    ),
    Mutant(
        name="sp_partial_sums_on_row_shards",
        fault="SP lets an unrecognised block's sub-layer compute its TP partial sums on row shards",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="""            (self._check_partial_sum(match, nodes) for match in reduces),
""",
        new="""            (None for match in reduces),  # the partial-sum check dropped
""",
        tests=("tests/test_spellings.py::test_an_unrecognised_block_ends_the_region_and_keeps_its_all_reduce",),
    ),
    Mutant(
        name="finder_counts_lookalikes",
        fault="the collapse finder takes every gated sum over [..., n, S] for an HC collapse (a delta-rule solve too)",
        file="hcpasses/patterns/collapse.py",
        old="""    if lead > MAX_TOKEN_DIMS:
        return f"{lead} leading dims (HC streams lead with [T] or [batch, seq])"
    if hidden <= n:
        return f"width {hidden} is not wider than its {n} streams"
    return None
""",
        new="""    del lead, hidden, n  # the shape check dropped
    return None
""",
        tests=("tests/test_corpus_sp.py::test_delta_rule_solve_steps_are_not_hc_blocks",),
        k="float32",
    ),
    Mutant(
        name="fuse_unrounded_mhc",
        fault="the fusion fuses an mHC sum left in fp32 over bf16 streams (the fused op rounds x: values change)",
        file="hcpasses/patterns/collapse.py",
        old="""        if self.unrounded:
            return (""",
        new="""        if self.unrounded and False:
            return (""",
        tests=("tests/test_canonical.py::test_mhc_collapse_whose_rounding_torch_211_folds_is_found_not_fused",),
    ),
    # The five promises of issue #23, broken as a refactor would break them (each was a planted fault that
    # survived the suite on 2026-12-02); tests/test_promises.py holds the tests written against each promise.
    Mutant(
        name="dispatch_threshold_exclusive",
        fault="with a symbolic T, T == sp_min_tokens runs the unsharded variant (the static path shards it)",
        file="hcpasses/backend.py",
        old="""        variant = "sharded" if self.tokens(args) >= self.min_tokens else "unsharded"
""",
        new="""        variant = "sharded" if self.tokens(args) > self.min_tokens else "unsharded"
""",
        tests=("tests/test_promises.py::test_symbolic_token_count_dispatches_at_the_threshold",),
    ),
    Mutant(
        name="rollback_drops_kwargs",
        fault="restore_graph rebuilds each node without its keyword arguments (dtype=, keepdim=, correction=)",
        file="hcpasses/verify.py",
        old="""            restored = graph.create_node(op, target, args, kwargs, name, type_)
""",
        new="""            restored = graph.create_node(op, target, args, {}, name, type_)
""",
        tests=("tests/test_promises.py::test_rolled_back_graph_compiles_to_what_eager_computes",),
    ),
    Mutant(
        name="cleanup_ignores_disable",
        fault="a disabled cleanup pass still runs (its record says unchanged or applied, not disabled)",
        file="hcpasses/manager.py",
        old="""        if not self.config.pass_enabled(name):
""",
        new="""        if not self.config.pass_enabled(name) and name != "cleanup":  # "cleanup is always safe"
""",
        tests=("tests/test_promises.py::test_every_pass_disabled_by_flag_or_env_does_not_run_and_says_why",),
    ),
    Mutant(
        name="dumps_for_unchanged_passes",
        fault="every pass that ran writes before / after / diff files, also when it left the graph unchanged",
        file="hcpasses/manager.py",
        old="""        if changed and dump is not None:
""",
        new="""        if dump is not None:
""",
        tests=("tests/test_promises.py::test_dumps_of_an_applied_an_unchanged_and_a_disabled_pass",),
    ),
    Mutant(
        name="cleanup_erases_impure_nodes",
        fault="cleanup erases every node whose result nothing uses, in-place writes and collectives included",
        file="hcpasses/passes/cleanup.py",
        old="""        graph.eliminate_dead_code()  # FX's own DCE keeps impure nodes; no need for our own walk
""",
        new="""        for node in reversed(list(graph.nodes)):  # "an unused result is dead code"
            if node.op == "call_function" and not node.users:
                graph.erase_node(node)
""",
        tests=("tests/test_promises.py::test_mutations_survive_every_pass_at_tp2",),
    ),
    Mutant(
        name="served_quants_left_in_the_graph",
        fault="a quant served by the fused codes is rewired but its nodes stay, computed for nothing until cleanup",
        file="hcpasses/passes/gated_mean_quant.py",
        old="""    _erase_unused(graph, (*quant.nodes, quant.source), stop=set())
""",
        new="""    del graph  # "cleanup erases what nothing reads"
""",
        tests=("tests/real_models/test_compile.py::test_hcpasses_backend_matches_eager",),
        k="qwen4_exp-1",
    ),
    Mutant(
        name="sp_pads_of_token_rows_are_row_local",
        fault="SP takes every constant pad as row-local, also one that shifts the token rows",
        file="hcpasses/passes/sp_rewrite/rules.py",
        old="""    if not any(layout.holds(dim) for dim, _ in padded):
""",
        new="""    if True:  # "a pad keeps the values where they are"
""",
        tests=("tests/test_spellings.py",),
        k="shifts_token_rows",
    ),
    Mutant(
        name="delta_rule_op_returns_the_kernels_strides",
        fault="the delta-rule op returns the kernel's output as it comes, a view of a padded buffer, not the "
        "contiguous tensor its fake implementation promises Inductor",
        file="hcpasses/hf/delta_rule_op.py",
        old="""        return out.contiguous(), query.new_empty(0, dtype=torch.float32)
""",
        new="""        return out, query.new_empty(0, dtype=torch.float32)  # "the kernel's layout is fine"
""",
        tests=("tests/real_models/test_delta_rule_op.py",),
        k="fake_agrees",
    ),
    Mutant(
        name="hf_contexts_leave_modules_patched",
        fault="the hf contexts patch transformers' modules and leave them patched after they exit",
        file="hcpasses/hf/module_patch.py",
        old="""        for name, current in saved.items():
            setattr(sys.modules[name], attribute, current)
""",
        new="""        saved.clear()  # "the flag reads right everywhere, keep it"
""",
        tests=("tests/real_models/test_export_check.py", "tests/real_models/test_delta_rule_op.py"),
        k="restore",
    ),
    Mutant(
        name="overlap_gemm_reads_untrimmed_rows_untrimmed",
        fault="overlap makes a GEMM read the gathered rows with their pad rows and never trims its result",
        file="hcpasses/passes/sp_rewrite/overlap.py",
        old="""            gemm.replace_all_uses_with(trim, delete_user_cb=lambda user, trim=trim: user is not trim)
""",
        new="""            gemm.graph.erase_node(trim)  # "the pad rows are zeros anyway"
""",
        tests=("tests/test_sp_overlap.py",),
        k="ragged",
    ),
    Mutant(
        name="overlap_scatter_pad_dropped",
        fault="overlap pads nothing into the row-parallel GEMM: the reduce-scatter gets N rows, not R*tp",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""        return gemm if isinstance(missing, int) and missing == 0 else gemm_on_padded_rows(gemm, missing)
""",
        new="""        return gemm  # "the scatter splits whatever it gets"
""",
        tests=("tests/test_sp_overlap.py",),
        k="ragged",
    ),
    Mutant(
        name="halo_from_own_rows",
        fault="a token window's halo takes the gathered rows of this rank (its own last rows), not the ranks' before",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""            stop = self.rank * m
""",
        new="""            stop = (self.rank + 1) * m  # "rank r's rows end at (r + 1) * m"
""",
        tests=("tests/test_sp_windows.py",),
        k="causal",
    ),
    Mutant(
        name="halo_assumes_long_shards",
        fault="a static R shorter than the window's reach still sends the last reach rows (wrapping into the shard)",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""        m = min(self.rows, reach) if isinstance(self.rows, int) else reach
""",
        new="""        m = reach  # "shards are always longer than a conv's reach"
""",
        tests=("tests/test_sp_windows.py",),
        k="causal",
    ),
    Mutant(
        name="symbolic_window_without_enough_rows",
        fault="with a symbolic T a token window is sharded where sp_min_tokens leaves ranks fewer rows than its reach",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="""                if not isinstance(self.rules.tokens, int) and fewest < layout.halo:
""",
        new="""                if not isinstance(self.rules.tokens, int) and fewest < 0:  # "the backend runs small T"
""",
        tests=("tests/test_sp_windows.py",),
        k="symbolic",
    ),
    Mutant(
        name="refused_hoists_kept",
        fault="a hoisted id feature the checks refuse stays hoisted: the refusal cuts the region instead",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="""            unhoisted = _left_out(verdict, hoisted) if verdict else set()
""",
        new="""            unhoisted = set()  # "what the ids feed is row-local"
""",
        tests=("tests/real_models/test_sp_real.py",),
        k="ple_runs",
    ),
    Mutant(
        name="kept_row_from_the_first_rank",
        fault="an exit's kept rows are taken from rank 0's block of the small gather, whichever rank holds them",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""                owner = call(aten.div.Tensor_mode, (rows, self.rows), {"rounding_mode": "floor"})
""",
        new="""                owner = call(aten.mul.Tensor, (rows, 0))  # "the gathered rows are in order"
""",
        tests=("tests/test_sp_kept_rows.py",),
        k="only_the_kept_rows",
    ),
    Mutant(
        name="kept_rows_from_the_start",
        fault="a slice keeping the last rows of a symbolic token dim keeps its first rows instead",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""            first = _proxy(sizes[d]) - first if d == kept.dim and kept.from_end else first
""",
        new="""            first = first  # "first is the slice's start"
""",
        tests=("tests/test_sp_kept_rows.py",),
        k="symbolic",
    ),
    Mutant(
        name="kept_rows_a_short_sequence_lacks",
        fault="with a symbolic token count, a slice is narrowed where sp_min_tokens allows fewer rows than it keeps",
        file="hcpasses/passes/sp_rewrite/kept.py",
        old="""        if -(-min_tokens // math.prod(others)) < least:
""",
        new="""        if False:  # "the graph asserts it anyway"
""",
        tests=("tests/test_sp_kept_rows.py",),
        k="would_not_gather",
    ),
    Mutant(
        name="refused_tail_node_drops_the_whole_tail",
        fault="a node after the HC blocks that is not row-local takes the whole tail out of the region with it",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="""            untailed = _left_out(verdict, tail) if verdict else set()
""",
        new="""            untailed = set()  # "the tail is row-local: it leads to a slice of rows"
""",
        tests=("tests/test_sp_kept_rows.py",),
        k="beside",
    ),
    Mutant(
        name="tail_failure_cuts_the_region",
        fault="a region that fails with its tail (or prologue) is not tried again without: the tail cuts the region",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="        if isinstance(region, NotShardable) and (tail or prologue):",
        new="        if False:",  # "the checks already left out what the tail cannot hold"
        tests=("tests/test_sp_kept_rows.py",),
        k="without_it",
    ),
    Mutant(
        name="kept_fp8_codes_sent_as_fp8",
        fault="an FP8 exit's kept rows travel as FP8, which gloo cannot send, instead of bytes",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""            source = call(aten.view.dtype, (node, torch.uint8)) if exit_.as_bytes else node
            flat = self._flatten_tokens(source, k, rest)
""",
        new="""            source = node  # "the all-gather moves any dtype"
            flat = self._flatten_tokens(source, k, rest)
""",
        tests=("tests/test_sp_kept_rows.py",),
        k="fp8",
    ),
    Mutant(
        name="kept_select_keeps_its_dim",
        fault="a select's kept row comes back with the selected dim still there (a slice's shape, not a select's)",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""            if kept.drops_dim:  # a select: its result has no such dim
""",
        new="""            if False:  # "a kept row is a kept row"
""",
        tests=("tests/test_sp_kept_rows.py",),
        k="select and not True",
    ),
    Mutant(
        name="shard_every_rank_slices_rank_zero",
        fault="the shard slices rows 0..R on every rank (each rank shards rank 0's rows)",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""        begin = 0 if self.rank == 0 else _node(_proxy(self.rows) * self.rank)  # ints stay ints
        end = self.rows if self.rank == 0 else _node(_proxy(self.rows) * (self.rank + 1))
""",
        new="""        begin, end = 0, self.rows  # "the slice is relative to this rank's shard"
""",
        tests=("tests/test_sp_rewrite.py::test_a_symbolic_token_count_shards_by_a_slice_of_the_padded_rows",),
    ),
    Mutant(
        name="shard_pads_with_ones",
        fault="the rows padded up to R*tp are ones, not zeros (the last rank's pad rows of the start)",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""        return self.graph.call_function(aten.constant_pad_nd.default, (flat, pad, 0.0))
""",
        new="""        return self.graph.call_function(aten.constant_pad_nd.default, (flat, pad, 1.0))
""",
        tests=("tests/test_sp_rewrite.py::test_a_symbolic_token_count_shards_by_a_slice_of_the_padded_rows",),
    ),
    Mutant(
        name="kept_row_picked_from_rank_zero",
        fault="one kept row of a static N is picked from rank 0's block of the gather, not from the rank holding it",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""                picked = call(aten.slice.Tensor, (gathered, 0, row // self.rows, row // self.rows + 1))
""",
        new="""                picked = call(aten.slice.Tensor, (gathered, 0, 0, 1))
""",
        tests=("tests/test_sp_kept_rows.py::test_only_the_kept_rows_are_gathered_after_a_final_norm_on_the_shards",),
    ),
    Mutant(
        name="kept_row_sent_from_the_first_local_row",
        fault="every rank sends its first row for one kept row of a static N, not the row's place in its shard",
        file="hcpasses/passes/sp_rewrite/emit.py",
        old="""                mine = call(aten.slice.Tensor, (flat, 0, row % self.rows, row % self.rows + 1))
""",
        new="""                mine = call(aten.slice.Tensor, (flat, 0, 0, 1))
""",
        tests=("tests/test_sp_kept_rows.py::test_only_the_kept_rows_are_gathered_after_a_final_norm_on_the_shards",),
    ),
    Mutant(
        name="qsa_batched_scores_unseen_blocks",
        fault="the batched QSA selection lets a query pick blocks it cannot see yet (no -inf past its complete blocks)",
        file="hcpasses/hf/qsa_batched.py",
        old="""                scores = scores.masked_fill(block_id >= complete[:, None], float("-inf"))
""",
        new="""                scores = scores.masked_fill(block_id >= blocks, float("-inf"))  # "all in the past"
""",
        tests=("tests/real_models/test_qsa_selection_op.py",),
        k="batched",
    ),
    Mutant(
        name="qsa_batched_rope_from_key_zero",
        fault="the batched QSA selection ropes each block key at its position counted from key 0, not from the start",
        file="hcpasses/hf/qsa_batched.py",
        old="""    firsts = torch.arange(blocks, device=raw_keys.device) * ratio + start
""",
        new="""    firsts = torch.arange(blocks, device=raw_keys.device) * ratio
""",
        tests=("tests/real_models/test_qsa_selection_op.py",),
        k="batched",
    ),
    Mutant(
        name="prologue_ignores_bytes",
        fault="a sub-layer's prologue joins the region whatever it leaves to gather (x gathered beside its norm)",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="""        return grown if sum(after) <= before else set()
""",
        new="""        return grown  # "on the shards is always cheaper"
""",
        tests=("tests/test_sp_prologue.py",),
        k="branch",
    ),
    Mutant(
        name="prologue_needs_fewer_bytes",
        fault="a sub-layer's prologue joins the region only where it leaves strictly fewer bytes (a bf16 norm of a "
        "bf16 x stays after the gather, on all T rows)",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="""        return grown if sum(after) <= before else set()
""",
        new="""        return grown if sum(after) < before else set()
""",
        tests=("tests/test_sp_prologue.py",),
        k="as_many",
    ),
    Mutant(
        name="prologue_drops_the_norm_weight",
        fault="a prologue step of as many bytes as its input is dropped even where it computes (the norm's weight "
        "multiplies the gathered rows, on all T of them)",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="""        return moved < kept or (moved == kept and is_pointwise(node) and node.target not in ELEMENTWISE)
""",
        new="""        return moved < kept
""",
        tests=("tests/test_sp_prologue.py",),
        k="as_many",
    ),
    Mutant(
        name="prologue_takes_gemms",
        fault="a sub-layer's prologue runs its GEMMs on the shards too: a TP-sharded GEMM's rows are gathered",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="""    return node.target in PROLOGUE_OPS or is_pointwise(node)
""",
        new="""    return node.target in PROLOGUE_OPS or is_pointwise(node) or node.target is aten.mm.default
""",
        tests=("tests/test_sp_prologue.py",),
        k="16-8",
    ),
    Mutant(
        name="prologue_drop_takes_later_blocks",
        fault="a prologue step dropped in one block takes every later block's steps with it (all its descendants)",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="""            grown -= self._fed_by(drops, grown)
""",
        new="""            grown -= descendants(self.graph, drops)
""",
        tests=("tests/real_models/test_sp_prologue_real.py",),
    ),
    Mutant(
        name="tensor_index_unreported",
        fault="a tensor index keeping a few token rows reads every row gathered, and the report says nothing of it",
        file="hcpasses/passes/sp_rewrite/region.py",
        old="            return indexed_rows(node, k, val.shape, self.rules.tokens, tp)",
        new="            return None",  # "only slices keep rows"
        tests=("tests/test_sp_kept_rows.py",),
        k="tensor_index",
    ),
    Mutant(
        name="lazy_variant_ignores_new_constraints",
        fault="a lazy unsharded compile that added shape guards Dynamo never checks is used all the same",
        file="hcpasses/backend.py",
        old="""        if not self.added:
            return compiled
""",
        new="""        if compiled is not None:  # "the compile succeeded, so the variant is good"
            return compiled
""",
        tests=("tests/unit/test_unit_backend.py",),
        k="gives",
    ),
    Mutant(
        name="lazy_inputs_drop_lifted_floats",
        fault="the lazy compile gets Dynamo's fakes for every tensor that is gone, tiny ones too (a lifted float)",
        file="hcpasses/backend.py",
        old="""    SMALL = 1  # elements: tensors up to this size are kept alive
""",
        new="""    SMALL = 0  # elements: tensors up to this size are kept alive
""",
        tests=("tests/test_lazy_variants.py",),
        k="lifted",
    ),
    Mutant(
        name="lazy_variant_outside_dynamo_context",
        fault="the lazy unsharded compile runs outside the Dynamo context it was made in (sizes specialised)",
        file="hcpasses/backend.py",
        old="""        with torch._guards.tracing(self.context):
            compiled = self._compile()
""",
        new="""        compiled = self._compile()
""",
        tests=("tests/unit/test_unit_backend.py",),
        k="first_small_call or context_it_was_made",
    ),
    Mutant(
        name="blocked_scan_nan_loses_to_carry",
        fault="the blocked scan's combine takes the earlier blocks' max over a NaN of the block (cummax propagates it)",
        file="hcpasses/passes/blocked_scans.py",
        old="""    if dtype.is_floating_point:
        own = call(aten.logical_or.default, own, call(aten.isnan.default, inner))
""",
        new="",
        tests=("tests/test_blocked_scans.py::test_the_blocked_scan_has_exactly_the_values_of_the_scan",),
    ),
    Mutant(
        name="blocked_scan_carry_includes_own_block",
        fault="each block is combined with the running max up to its own end, not up to the block before it",
        file="hcpasses/passes/blocked_scans.py",
        old="""    earlier = call(aten.slice.Tensor, carry, -1, 0, -1)
    before = call(aten.unsqueeze.default, call(aten.constant_pad_nd.default, earlier, [1, 0], _lowest(dtype, kind)), -1)
""",
        new="""    before = call(aten.unsqueeze.default, carry, -1)
""",
        tests=("tests/test_blocked_scans.py::test_the_blocked_scan_has_exactly_the_values_of_the_scan",),
    ),
    Mutant(
        name="blocked_scans_ask_inner_heuristic_only",
        fault="the gate asks Inductor's inner-reduction heuristic only (blocks Inductor reads as outer split to ATen)",
        file="hcpasses/passes/blocked_scans.py",
        old="""    return factor(inner_reduction=True) > 1 or (rows > 1 and factor(inner_reduction=False) > 1)""",
        new="""    return factor(inner_reduction=True) > 1""",
        tests=("tests/test_blocked_scans.py",),
        k="inductor",
    ),
    Mutant(
        name="blocked_scans_carry_never_blocked",
        fault="the carry's scan is left as one scan however long (Inductor splits a carry of over 8192 blocks)",
        file="hcpasses/passes/blocked_scans.py",
        old="""    carry, deeper = _blocked_values(graph, target, last, [*outer, blocks], dtype, choose)""",
        new="""    carry, deeper = call(operator.getitem, call(target, last, -1), 0), []""",
        tests=("tests/test_blocked_scans.py",),
        k="carry",
    ),
    Mutant(
        name="blocked_scans_take_read_indices",
        fault="a scan whose indices are read is blocked too (its indices become the values)",
        file="hcpasses/passes/blocked_scans.py",
        old="""or (user.args[1] != 0 and user.users) for user in scan.users):""",
        new="""and user.users and False for user in scan.users):""",
        tests=("tests/test_blocked_scans.py",),
        k="indices",
    ),
    Mutant(
        name="token_rows_floor_quotient_unproven",
        fault="a reshape's floor-divided rows are taken for the tokens without the shape env's proof",
        file="hcpasses/passes/sp_rewrite/tokens.py",
        old="""candidate > 0 and same_size(size, int(candidate) * divisor):""",
        new="""candidate > 0:""",
        tests=("tests/test_sp_layouts.py",),
        k="guard",
    ),
    Mutant(
        name="token_rows_floor_quotient_ignored",
        fault="rows seqs*(T//seqs) from a sequence view are never the tokens (the region is cut at every write-back)",
        file="hcpasses/passes/sp_rewrite/tokens.py",
        old="""    if candidate.is_Integer and candidate > 0""",
        new="""    if False and candidate.is_Integer and candidate > 0""",
        tests=("tests/test_sp_seq_split.py",),
        k="one_region",
    ),
    Mutant(
        name="qsa_stand_in_takes_every_block",
        fault="the QSA op's stand-in indexer keeps token_budget blocks, not token_budget // compress_ratio",
        file="hcpasses/hf/qsa_selection_op.py",
        old="""        block_topk=token_budget // compress_ratio,""",
        new="""        block_topk=token_budget,""",
        tests=("tests/real_models/test_qsa_selection_op.py",),
        k="bit_for_bit",
    ),
    Mutant(
        name="qsa_op_covers_a_grouped_key_norm",
        fault="an indexer whose key norm is grouped goes to the op, which rebuilds the norm without its groups",
        file="hcpasses/hf/qsa_selection_op.py",
        old="""        and getattr(norm, "group_size", None) is None
""",
        new="",
        tests=("tests/real_models/test_qsa_selection_op.py",),
        k="does_not_cover",
    ),
    Mutant(
        name="qsa_context_keeps_the_op",
        fault="the QSA context leaves the op caller on the class after it exits",
        file="hcpasses/hf/qsa_selection_op.py",
        old="""        for cls, method in zip(classes, saved, strict=True):
            setattr(cls, METHOD_NAME, method)""",
        new="""        pass""",
        tests=("tests/real_models/test_qsa_selection_op.py",),
        k="restores",
    ),
)
