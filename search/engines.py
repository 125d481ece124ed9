"""The engine that runs a plan, as the cost model prices it.

A plan is priced as the engine that will run it runs it: Partita's own runtime (``partita
launch``), torchtitan, Megatron-LM or DeepSpeed, each as ``partita export --to X`` configures
it. An engine differs from another in what it overlaps, how it gathers ZeRO-3 parameters and
what its loss keeps; ``ENGINES`` holds each one's behaviour with the source of every default,
and a plan records the engine's name (``Plan.engine``). Published runs (benchmarks/
published_runs.py) start from their engine and state what their configuration changed
(``Engine.with_options``).

The terms each behaviour selects, in one place each:

* ``attention``, ``grad_sync``: the attention kernel (search/analytic.py, ``ATTENTION``) and when
  data-parallel gradient reductions start (search/costs/layer_time.py).
* ``tp_overlap``: tensor-parallel all-gathers and reduce-scatters split into chunks and run
  beside the matrix products they feed (Megatron's ``--tp-comm-overlap``, Transformer Engine's
  userbuffers; torchtitan's async TP under ``torch.compile``). Only the first chunk is exposed:
  1/tp of the collective; the rest runs beside the compute and slows it by the overlap slowdown
  (``layer_time.tp_exposed_s``); in a block each collective beside its own products only, the
  part longer than them exposed (``layer_time.tp_overlap_exposed_s``). Needs sequence
  parallelism (an all-reduce cannot be split so).
* ``tp_overlap_impl``: what runs the chunked collectives under ``tp_overlap``. "userbuffers"
  (Transformer Engine's, Megatron-LM's ``--tp-comm-overlap``) or "symmetric_memory" (torch's
  micro-pipelined TP, torchtitan's async TP: torch/distributed/_symmetric_memory/__init__.py),
  which adds two memory-bound passes on the compute stream: before a fused all-gather's first
  barrier the rank's shard is copied into its symmetric buffer ("we are giving up the chance to
  overlap 'mv' and 'b' with the first shard_consumer"), and after a fused reduce-scatter's
  products the tp partial chunks it pulled are summed (``reduce_fn`` over ``stacked_partials``:
  the whole output read, a tp-th written) (``layer_time.tp_overlap_exposed_s``). Time.
* ``column_linears``: whether a layer's column-parallel products of one input are one linear
  ("fused": Megatron-LM's ``linear_qkv`` and ``linear_fc1``) or one linear each ("separate": the
  torch models' wq, wk, wv and w1, w3, torchtitan's and Partita's). Under ``tp_overlap`` it
  decides the backward: the input gradient of separate linears is the sum of their products,
  and torch's async TP fuses a reduce-scatter only with the one product that makes its input
  (torch/_inductor/fx_passes/micro_pipeline_tp.py, ``fuse_matmul_reduce_scatter``:
  ``_find_producer_matmul`` finds none behind a sum, and the reduce-scatter stays as it was), so
  the block's two input-gradient reduce-scatters run exposed after their products
  (``layer_time.tp_pass``). The forward's gathers feed the products directly and are chunked
  (``fuse_all_gather_matmul`` takes every consumer product), as are the backward's gathers of
  the output gradients. Userbuffers overlap the fused linear's reduce-scatter with its single
  product (Transformer Engine's ``ub_overlap_rs_dgrad``).
* ``dgrad_overlap``: a column-parallel linear's input-gradient reduction (the attention's q, k, v
  and the MLP's first product in a block, the output layer in the head: an all-reduce, or a
  reduce-scatter under sequence parallelism) started asynchronously before the linear's
  weight-gradient product and waited for after it (Megatron-LM,
  ``LinearWithGradAccumulationAndAsyncCommunication.backward``: "all-reduce is scheduled before
  the weight gradient computation", megatron/core/tensor_parallel/layers.py; Transformer Engine's
  column-parallel linears likewise, layernorm_linear.py's ``dgrad_work``; on by default since
  September 2021, commit 3f65246, ``--no-async-tensor-model-parallel-allreduce`` before
  Megatron-Core). Priced per linear beside its own weight-gradient product
  (``layer_time.dgrad_exposed_s``): the reduction's excess over the product and the product's
  slowdown while both run. The row-parallel linears' collectives (the forward's reductions, the
  backward's all-gathers under SP) stay exposed. Partita's runtime runs each group of column-
  parallel products of one input (q, k, v; the MLP's first products; the output layer) as one
  autograd function that does the same (``runtime.tp_linear``); DTensor's backward (torchtitan in
  eager mode) waits for each collective where it is issued.
* ``selective_scope``: what ``recompute: selective`` recomputes. "ops" (Partita's runtime:
  torch's selective checkpointing keeps every matrix product's output and recomputes the rest of
  the block, norms, activations and the attention core, ``analytic.
  selective_recompute_time_s``), "alternate" (torchtitan's ``selective_ac_option = "op"``, which
  ``partita export --to torchtitan`` writes: its policy keeps the attention kernel's outputs, the
  reduce-scatters' and every matrix product's but every second one, so a llama block runs wk, wo
  and w3 again with the elementwise work and not its attention core; ``analytic.
  alternate_recomputed``; torchtitan/models/llama3/parallelize_llama.py ``_save_list``, 2024-25) or
  "attention" (Megatron-LM's ``--recompute-granularity
  selective``: only the attention core, from q, k, v to its output, is checkpointed and run again,
  ``TransformerBlock``'s ``recompute_granularity == 'selective'`` / ``_checkpointed_attention_forward``;
  Korthikanti et al. 2022, sec. 5: everything else is kept). Under "attention" the recomputation
  is the core's forward, with no tensor-parallel collective, and the block keeps what it keeps
  without recomputation less the core's own tensors (which a fused kernel does not keep anyway).
* ``p2p_overlap``: an interleaved schedule's pipeline sends and receives posted before the next
  virtual stage's compute and waited for after it, priced beside the compute
  (``stage.with_p2p_overlap``). Megatron's ``overlap_p2p_comm``, on by default in its training
  script for interleaved schedules (megatron/training/arguments.py,
  ``--no-overlap-p2p-communication``). ``torch.distributed.pipelining``'s schedules of several
  stages a rank (Partita's runtime, torchtitan) do it too: ``_add_send_recv`` puts each receive
  on the receiving rank's list as soon as its sender has computed, "as early as possible (ASAP)
  to overlap P2P communication with computation" (``_defer_recv_ops``' docstring), and
  ``_PipelineScheduleRuntime`` waits for the sends at the step's end (schedules.py; an
  interleaved stage of the runtime holds a second receive buffer, posted while the chunk before
  it runs: tests/test_runtime_boundary.py). Priced so since the interleaved bound holds every
  moment of torch's order at once where it matters (``interleaved_bound.variant_bound_s``'s
  ``exact``): before, its one weighting at a time left the plans of
  ``benchmarks/search_targets.py`` unproven within their 1 % (llama-2-70b on 64 H100 at pp 8:
  2.9 %). DeepSpeed's pipeline engine sends and receives blocking.
* ``zero3_gathers``: how many all-gathers ZeRO-3 runs for one layer's parameters. FSDP and FSDP2
  gather a block as one unit ("layer": Partita's runtime and torchtitan wrap each block).
  DeepSpeed's ZeRO-3 fetches parameters module by module as its hooks meet them
  (``PartitionedParameterCoordinator.fetch_sub_module``); a parameter under
  ``stage3_param_persistence_threshold`` (1e5 elements) stays whole, so a block gathers once per
  linear layer ("module": ``linear_modules``). Each gather is a ring of n - 1 steps that
  pays a hop's latency on every step (the network's where it crosses between nodes): at a fixed
  layer and growing dp, latency, not bytes, sets the time (docs/calibration.md, "Collectives at
  scale").
* ``zero3_overlap``: whether ZeRO-3's per-micro-batch gathers and reduce-scatters run beside the
  layers' compute (FSDP's prefetch: Partita's runtime, torchtitan, Megatron's distributed
  optimizer) or after it, one after the other (DeepSpeed: False). DeepSpeed 0.6.2's published
  sweep on Azure (the 175B model at micro-batches 1 to 16 on 128 to 1,024 A100, the 530B at 1 to 8
  on 512 and 1,024; docs/published_runs.md, eleventh session, item 2)
  measured a step longer than its compute by the same seconds at every micro-batch of a GPU
  count, and by about the traffic priced serially: at micro-batch 16 the compute of a 175B
  module is sixteen times its gather, which any overlap would hide. Its prefetcher runs one
  module ahead on its own stream (``PartitionedParameterCoordinator.fetch_sub_module``), but
  the runs behave as if it did not; newer DeepSpeed releases rewrote the trace and prefetch
  (DeepSpeed#1916, #2016) and no published run of them is here, so the engine prices what was
  measured.
* ``zero2_gather``: when a ZeRO-2 layer's parameters are all-gathered. "micro_batch" (FSDP's
  SHARD_GRAD_OP, FSDP2 with ``reshard_after_forward=False``: Partita's runtime, torchtitan): each
  micro-batch gathers them for its forward and keeps them to its backward's end, then reshards.
  "step" (DeepSpeed's ZeRO stage 2, ``DeepSpeedZeroOptimizer``: the bit16 parameters stay whole,
  ``bit16_groups_flat``, and after the optimizer step ``all_gather_dp_groups`` "Gather[s] the
  updated weights from everyone", once a step; its gradients are reduced into their partitions in
  every backward when it partitions them, ``reduce_ready_partitions_and_remove_grads``;
  deepspeed/runtime/zero/stage_1_and_2.py): one all-gather a step beside the data-parallel sync,
  no gather per micro-batch, and no gather's buffer at a forward's peak (``layer_time.zero_traffic``,
  ``costs.memory.dense_memory``). The reduce-scatter of every micro-batch is the same on both.
* ``shard_copies``: the copies around each per-micro-batch ZeRO gather and reduction that run on
  the compute stream. "fsdp2" (Partita's runtime and torchtitan: FSDP2 shards parameter by
  parameter, so after each all-gather ``foreach_all_gather_copy_out`` copies the gathered buffer
  out into the unsharded parameters, ``split_with_sizes_copy`` on the current stream, and before
  each reduce-scatter ``foreach_reduce_scatter_copy_in`` copies the unsharded gradients into the
  reduce-scatter input in the reduce dtype, ``chunk_cat``, on the current stream: "Only after the
  copy-in finishes can we free the gradients"; torch/distributed/fsdp/_fully_shard/
  _fsdp_collectives.py), "fsdp1" (FSDP1's flat parameters, torch.distributed.fsdp's
  ``FlatParameter``: gathered straight into the unsharded flat parameter, which the parameters
  view, so the forward copies nothing; the views are made with ``torch.split``, whose backward
  concatenates the parameters' gradients into the flat gradient on the compute stream, and the
  post-backward hook then casts that gradient to the reduce dtype and divides it by the
  pre-divide factor, in place, on its own stream before the reduce-scatter:
  ``_flat_param.py``, ``_get_unflat_views``; ``_runtime_utils.py``, ``_post_backward_hook``,
  ``_reduce_grad``, ``_div_if_needed``; llm-foundry's Composer and IBM's fms-fsdp train so) or
  "none" (Megatron-LM's contiguous parameter and gradient buffers; DeepSpeed's copies are not
  priced). Priced as memory-bound kernels (``layer_time.shard_copies_s``): FSDP2's in the
  layer's passes, per gather 2 x its bytes, per reduction the gradients' bytes in the compute
  dtype and the reduce dtype; FSDP1's concatenation in the backward pass (2 x the gradients'
  bytes), its cast and division beside it with the reduction they precede (the post-backward
  stream runs them one after the other).
* ``param_gather``: when the once-a-step all-gather of the updated parameters (ZeRO-1, and
  ZeRO-2 under ``zero2_gather`` "step") runs. "next_forward": layer by layer beside the next
  step's first forward, each layer's gather waited for where the layer starts (Partita's runtime
  and torchtitan: FSDP2 units that keep their parameters gathered through the step's
  micro-batches, ``reshard_after_forward=False``, reshard after the last backward and gather
  again in the next forward's pre-hooks, on FSDP2's all-gather stream; Megatron-LM's
  ``--overlap-param-gather``, which ``partita export --to megatron`` writes:
  ``DistributedOptimizer`` dispatches the first bucket's all-gather after the step and each
  forward pre-hook waits for its bucket and dispatches the next, megatron/core/optimizer/
  distrib_optimizer.py). Priced as the reductions are: the layer's gather joins its per-step
  sync and the layer's first forward joins the window it hides behind, up to the gather's own
  time (``layer_time``).
  "after_step" (DeepSpeed's ZeRO 1 and 2: ``all_gather_dp_groups`` right after the optimizer
  step, stage_1_and_2.py, before the next forward starts): exposed, charged with the step's
  update (the optimizer term).
* ``fp16_grad_reduce``: gradients reduced in fp16 when the plan trains in fp16 (Megatron-LM
  without ``--accumulate-allreduce-grads-in-fp32``; DeepSpeed's ZeRO, whose
  ``communication_data_type`` defaults to the gradients' dtype), half the bytes of the fp32
  reductions FSDP2's ``reduce_dtype`` runs (Partita's runtime, torchtitan). bf16 reduces in fp32
  on every engine (Megatron forces it: megatron/arguments.py, "bfloat16 requires gradient
  accumulation and all-reduce to be done in fp32"; DeepSpeed's BF16_Optimizer keeps fp32
  gradients). Communication only: the memory keeps fp32 gradient buffers (``costs.memory``).
* ``grad_buffer``: the dtype gradients are accumulated, held and reduced in. "fp32" (every
  engine's default: FSDP2's ``reduce_dtype``, Megatron-LM's fp32 ``main_grad`` buffers,
  DeepSpeed's fp32 gradient partitions; fp16 reductions aside, ``fp16_grad_reduce``) or
  "compute": NeMo's ``distributed_fused_adam`` with ``grad_sync_dtype`` bf16 (Apex's
  ``DistributedFusedAdam`` allocates its contiguous gradient buffer in ``grad_sync_dtype``,
  ``_init_grad_buffer``; NVIDIA's NeMo recipes set it). Memory and the data-parallel reductions'
  bytes (``costs.memory.state_bytes``, ``CostModel.reduce_bytes``).
* ``reduce_dtype``: the dtype gradients are reduced in where they are held otherwise. "fp32"
  (every engine's default, as ``grad_buffer``) or "compute": FSDP's ``MixedPrecision`` with a
  ``reduce_dtype`` of bf16 over fp32 parameters (IBM's fms-fsdp ``bfSixteen`` policy): the
  reduce-scatters move the compute dtype, the sharded gradients are cast back to the
  parameters' fp32 after them. Communication only (``CostModel.reduce_bytes``).
* ``expert_tp``: how a mixture of experts' experts run under tensor parallelism (with sequence
  parallelism, ``parallel.moe_tp_rule``). "whole" (every engine as Partita runs and exports it:
  ``partita export --to megatron`` writes ``--expert-tensor-parallel-size 1``): each rank runs
  whole experts on its own sequence shard's rows. "split": each expert's weights split over the
  tp ranks, which all-gather their routed rows over tp before the experts and reduce-scatter the
  outputs after (Megatron-Core's default, expert tensor parallelism = tp, its only mode before
  0.10: ``MoEAlltoAllTokenDispatcher``, ``gather_from_sequence_parallel_region`` and
  ``reduce_scatter_to_sequence_parallel_region``, megatron/core/transformer/moe/
  token_dispatcher.py at core_v0.9.0; NVIDIA's Grok-1 recipe ran so). The same expert FLOPs a
  rank; the experts' state a tp-th (``experts.moe_parts``), the gathered rows kept for the
  weight gradients (``costs.memory``), the gather and reduce-scatter on the critical path
  (``experts.expert_tp_s``).
* ``expert_ranks``: which ranks an expert-parallel group spans. "data_parallel": ep of the
  data-parallel ranks, tp x cp apart (Partita's runtime, whose mesh carves ep out of dp;
  Megatron-Core before 0.10, order "tp-cp-ep-dp-pp" with ep taken from dp: parallel_state.py at
  core_v0.9.0, ``RankGenerator``). "folded": Megatron-Core 0.10 and later build the experts'
  groups with their own rank generator (``expert_decoder_rank_generator``: tp the expert tp, cp
  1, then ep), so the ep ranks are expert-tp apart, consecutive ranks under whole experts, and an
  ep group of up to a node's GPUs all-to-alls over NVLink however the attention is split ("MoE
  parallel folding"); ``partita export --to megatron`` writes ``--expert-tensor-parallel-size``,
  a 0.10 flag, so the megatron engine prices this. The all-to-alls' link (``experts.ep_link``).
* ``optimizer_state``: the dtype of the optimizer's master copy and Adam's moments. "fp32"
  (every engine's default: 12 bytes a parameter, sharded at ZeRO 1-3) or "compute" (Apex's
  ``DistributedFusedAdam`` with ``dtype`` bf16, "datatype for optimizer state", which NeMo's
  Nemotron-4 340B recipe sets: 3 x 2 bytes). Memory.
* ``sp_inputs``: under sequence parallelism, what a tensor-parallel linear keeps of its
  all-gathered input for the weight gradient: "whole" (DTensor's autograd keeps the gathered
  tensor: torchtitan) or "sharded" (Megatron-LM keeps its sequence shard and all-gathers it again
  in the backward, asynchronously beside the input-gradient product:
  ``LinearWithGradAccumulationAndAsyncCommunication.backward``; Korthikanti et al. 2022, sec.
  4.2.2; Partita's runtime likewise, ``runtime.tp_linear``). Sharded: the block's two linear
  inputs and the head's take 1/tp of the bytes (``analytic.activation_bytes``), each backward
  re-gathers them beside its compute (``layer_time``) and holds the gathered input while its
  weight gradients run (``costs.memory``).
* ``glu_saves``, ``qkv_saves``: which SwiGLU and attention kernels a block runs, and so what
  they keep for the backward (``analytic.activation_bytes``) and what elementwise work they do
  (``Engine.kernels``, search/kernels.py: a fused SwiGLU is one kernel, an attention kernel at
  the kv heads needs no copies of k and v). "outputs" / "repeated" (the torch stack: Partita's runtime,
  torchtitan, Hugging Face models under DeepSpeed): SwiGLU keeps silu's output beside its inputs
  and the product, and attention takes k and v repeated to the query heads (the models'
  ``repeat_kv`` / ``repeat_interleave`` before SDPA). "input" / "fused" (Megatron-LM with
  Transformer Engine): the fused SwiGLU keeps only its input and recomputes silu
  (``SwiGLUFunction``, on by default: ``--no-bias-swiglu-fusion`` turns it off), and one qkv
  projection split into views feeds an attention kernel that takes k and v at their kv heads
  (``TEDotProductAttention``, ``num_gqa_groups``). Memory and time.
* ``norm``: how a llama layer's RMSNorm runs (``kernels.norm_bytes_per_element``). "fused" (every
  engine as it runs today: torch's fused CUDA ``rms_norm`` under Partita's runtime and
  torchtitan's ``nn.RMSNorm``, pytorch#153666; Transformer Engine's and apex's kernels;
  torch.compile's fusion) or "eager": the norm as a Python module of torch ops, an fp32 upcast,
  pow, mean, rsqrt, two products and a downcast, each its own kernel (torchtitan's ``RMSNorm``
  with ``norm_type = "rmsnorm"`` and ``compile = false``, its train configs from April to
  December 2024: 9x the fused kernel's bytes forward, 11x backward, and an fp32 copy of
  the input kept). Time and memory.
* ``reduce_bucket`` (elements; DeepSpeed's ``reduce_bucket_size``, default 5e8): with
  module-by-module gathers, the bucket ZeRO-3's gradients are reduce-scattered through. A
  gradient larger than the bucket is reduced alone, so a block of large linears runs one
  reduce-scatter a weight (and one a bias between them), each paying the ring's latency
  (``reduce_flushes``). Under full recomputation the backward gathers every module again for
  the recomputed forward and once more for the modules whose reuse lies beyond
  ``stage3_max_reuse_distance`` (``recompute_regathers``; ``layer_time.zero3_recompute_s``).
* ``max_reuse_distance`` (elements; DeepSpeed's ``stage3_max_reuse_distance``, default 1e9): the
  reuse distance within which a module's parameters stay gathered (``recompute_regathers``).
* ``p2p_buffers``: what a pipeline stage holds for its transfers (``costs.memory.pipeline_memory``).
  "per_micro_batch" (``torch.distributed.pipelining`` as it comes: a receive buffer per
  micro-batch and direction for every virtual stage, allocated once, and each stage output kept
  until its backward: torchtitan; DeepSpeed's pipeline engine too, which keeps a buffer per
  micro-batch in flight, priced so as the safe side), "on_receive" (Partita's runtime: torch's
  schedules with each receive buffer allocated when its receive is posted and let go of after
  its chunk, ``runtime.schedule.ReceiveOnDemandStage``: a received activation becomes the stage
  input kept for that micro-batch's backward, which is its first block's saved input and counted
  with its activations; a received gradient lives through its backward only; stage outputs kept
  as torch keeps them) or "per_transfer" (Megatron-LM: each
  receive is allocated when posted, ``p2p_communication._communicate``, and becomes the next
  layer's input, counted with its activations; a sent output's storage is freed at once,
  ``schedules.deallocate_output_tensor``, which its training script turns on with
  ``deallocate_pipeline_outputs``): one buffer per direction in flight and no kept outputs.
* ``rope``: rotary positions as torch's rotate-half ops ("unfused", five kernels a tensor) or one
  fused kernel ("fused": Transformer Engine's ``fused_apply_rotary_pos_emb``, Megatron-LM's
  default, ``--no-rope-fusion`` turns it off; search/kernels.py). Time.
* ``attention_padding``: "none" (every engine: the attention kernel takes the batch as it is) or
  "unpad" (llm-foundry's ``attn_impl: flash``: flash-attn's variable-length kernel behind
  ``bert_padding``, which copies q, k and v into packed rows and scatters the output back, and
  the reverse in the backward; search/kernels.py). Time.
* ``cp_ring``: how a ring of context-parallel ranks passes K and V (``cp_variant`` ring;
  search/context.py). "torch" (``torch.distributed``'s context parallelism: Partita's runtime,
  torchtitan): the blocks at the query heads (the models repeat kv heads before SDPA), the
  dK/dV accumulators in fp32 around the whole ring. "transformer_engine" (Megatron-LM's
  ``--context-parallel-size``, Transformer Engine's ``AttnFuncWithCPAndKVP2P``): the blocks at
  the kernel's kv heads in the compute dtype, the backward's dK/dV riding with the K/V blocks,
  one pass a step (``context.te_ring_traffic``); and under ``cp_variant`` all_gather its
  ``AttnFuncWithCPAndKVAllGather`` saves the rank's own k and v, not the gathered ones, and
  gathers them again for the backward (transformer_engine/pytorch/attention/
  dot_product_attention/context_parallel.py: ``save_for_backward`` of the local k, v,
  ``gather_along_first_dim`` in ``backward``), where the torch models keep the gathered K and V.
  Time and memory.
* ``matmul``: the dtype of a block's linear layers' products: "compute" (the plan's dtype) or
  "fp8" (a plan's ``fp8``: Transformer Engine's FP8 layers, Megatron-LM's ``--fp8-format
  hybrid``, e4m3 forward and e5m2 gradients with delayed scaling). Priced at the part's FP8
  peak and the share of it FP8 products reach (``roofline.FP8_OVER_BF16_SHARE``), with the
  casts they add (search/kernels.py, ``fp8_casts``); the output layer and the attention core keep
  the compute dtype (``analytic.product_dtype``); dense models only (``parallel.fp8_rule``). Memory: with FP8
  parameters (``--fp8-param-gather``, NeMo's ``fp8_params``; ZeRO 1 and up) a weight and its
  transposed copy take the bytes one bf16 weight did; at ZeRO 0 the two FP8 copies sit beside the
  bf16 weight (``costs.memory.dense_memory``); the linears' inputs kept for the weight gradients
  are FP8 (``analytic.activation_bytes``, ``fp8_inputs``). The megatron and torchtitan engines
  run it (``parallel.FP8_ENGINES``). Time and memory.
* ``zero1_reduce``: how ZeRO 1 reduces the step's gradients before each rank updates its shard:
  "reduce_scatter" (Megatron's distributed optimizer, FSDP, DeepSpeed's ZeRO 1 in fp16) or
  "all_reduce" (DeepSpeed's BF16_Optimizer, which bf16 training under its pipeline engine runs at
  ZeRO stage 0 as its own ZeRO 1: ``PipelineEngine._bf16_reduce_grads`` all-reduces the fp32
  gradients, ``buffered_allreduce_fallback``, before the sharded update and its all-gather;
  deepspeed/runtime/pipe/engine.py at v0.6.7): twice the reduce-scatter's bytes. A published
  run's option (BLOOM's). Time.
* ``grad_accumulate``: how a micro-batch's gradients join the step's. "in_place" (written where
  they accumulate: Megatron's fused weight-gradient products into ``main_grad``, FSDP's
  reductions, autograd's ``.grad``; no pass of its own) or "cast_add" (DeepSpeed's BF16_Optimizer:
  after every micro-batch's backward each bf16 gradient is cast to fp32 and added into its fp32
  copy, ``update_hp_grads``, deepspeed/runtime/bf16_optimizer.py at v0.6.7: the compute dtype
  read, 4 + 12 fp32 bytes a parameter; ZeRO 0-1; ``layer_time.grad_accumulate_s``). BLOOM's. Time.
* ``fp8_impl``, ``fp8_gather``: whose FP8 layers run those products. "transformer_engine"
  (megatron, above) or "torchao" (torchtitan's float8 converter: torchao's ``Float8Linear``,
  dynamic tensorwise scaling, each input and output gradient abs-maxed and cast as it comes and
  the FP8 operands transposed for the products that need them column-major: search/kernels.py,
  ``fp8_casts``; it saves its FP8 input for the weight gradient, as Transformer Engine does), or
  "torchao_hp" (torchao from 2025, the torchtitan engine's: the input saved in the compute dtype
  and cast again in the backward).
  ``fp8_gather``: FSDP all-gathers the linear layers' weights already cast to FP8 (torchao's
  ``enable_fsdp_float8_all_gather`` with precomputed scales): a ZeRO 2-3 gather moves, copies and
  holds a byte a linear weight instead of the compute dtype's (``CostModel.gather_bytes``). Time
  and memory.
* ``loss``: "chunked" (Partita's runtime: runtime.schedule.ChunkedCrossEntropy, the logits kept in
  the compute dtype and an fp32 chunk at a time), "fp32" (the logits cast to fp32 before torch's
  cross entropy, the fp32 log-probabilities kept for its backward, which makes new gradients:
  torchtitan's ``cross_entropy_loss``, Hugging Face models under DeepSpeed) or "fp32_in_place"
  (Megatron-Core's vocab-parallel cross entropy: the fp32 logits turned into the softmax in place
  and kept, the backward writing the gradient over it, ``VocabParallelCrossEntropy.
  prepare_gradient_calculation_operands``: ``grad_input = softmax``; only the cast back to the
  logits' dtype is new); search/costs/memory.py, ``loss_transient``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from partita import parallel, specio
from partita.errors import PartitaError
from partita.search.analytic import GLU_SAVES, QKV_SAVES
from partita.search.kernels import FP8_IMPLS, Kernels
from partita.search.timing import Software

ZERO3_GATHERS = ("layer", "module")
# DeepSpeed's ZeRO reduce_bucket_size default (elements): gradients are reduced through a bucket
# of this size (deepspeed/runtime/zero/config.py, 5e8); ``Engine.reduce_bucket``.
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# DeepSpeed's stage3_max_reuse_distance default (elements; deepspeed/runtime/zero/constants.py):
# a module's parameters stay gathered after it runs if they are used again within this many
# parameters of the traced fetch order (PartitionedParameterCoordinator.__params_to_release).
DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000
P2P_BUFFERS = ("per_micro_batch", "on_receive", "per_transfer")
ZERO2_GATHERS = ("micro_batch", "step")
SHARD_COPIES = ("fsdp2", "fsdp1", "none")
EXPERT_TPS = ("whole", "split")
TP_OVERLAP_IMPLS = ("userbuffers", "symmetric_memory")
EXPERT_RANKS = ("data_parallel", "folded")
PARAM_GATHERS = ("next_forward", "after_step")
SELECTIVE_SCOPES = ("ops", "attention", "alternate")
LOSSES = ("chunked", "fp32", "fp32_in_place")
SP_INPUTS = ("whole", "sharded")
COLUMN_LINEARS = ("separate", "fused")
CP_RINGS = ("torch", "transformer_engine")
ZERO1_REDUCES = ("reduce_scatter", "all_reduce")
GRAD_ACCUMULATES = ("in_place", "cast_add")
DTYPE_CHOICES = ("fp32", "compute")


@dataclass(frozen=True)
class Engine:
    """How one training engine runs a plan's layers (the module docstring gives each field's terms)."""

    name: str
    attention: str = "sdpa"
    grad_sync: str = "overlapped"
    tp_overlap: bool = False
    tp_overlap_impl: str = "userbuffers"
    p2p_overlap: bool = False
    dgrad_overlap: bool = False
    selective_scope: str = "ops"
    zero3_gathers: str = "layer"
    zero3_overlap: bool = True
    zero2_gather: str = "micro_batch"
    shard_copies: str = "none"
    param_gather: str = "next_forward"
    loss: str = "chunked"
    fp16_grad_reduce: bool = False
    sp_inputs: str = "whole"
    p2p_buffers: str = "per_micro_batch"
    glu_saves: str = "outputs"
    qkv_saves: str = "repeated"
    reduce_bucket: int = DEEPSPEED_REDUCE_BUCKET
    max_reuse_distance: int = DEEPSPEED_MAX_REUSE_DISTANCE
    norm: str = "fused"
    column_linears: str = "separate"
    cp_ring: str = "torch"
    grad_buffer: str = "fp32"
    reduce_dtype: str = "fp32"
    optimizer_state: str = "fp32"
    expert_tp: str = "whole"
    expert_ranks: str = "data_parallel"
    rope: str = "unfused"
    matmul: str = "compute"
    attention_padding: str = "none"
    fp8_impl: str = "transformer_engine"
    fp8_gather: bool = False
    zero1_reduce: str = "reduce_scatter"
    grad_accumulate: str = "in_place"

    def __post_init__(self) -> None:
        Software(attention=self.attention, grad_sync=self.grad_sync)  # its checks of the two names
        specio.check_choices(self, (("zero3_gathers", ZERO3_GATHERS), ("selective_scope", SELECTIVE_SCOPES),
                                    ("zero2_gather", ZERO2_GATHERS), ("shard_copies", SHARD_COPIES), ("param_gather", PARAM_GATHERS), ("loss", LOSSES),
                                    ("p2p_buffers", P2P_BUFFERS), ("sp_inputs", SP_INPUTS), ("glu_saves", GLU_SAVES),
                                    ("qkv_saves", QKV_SAVES), ("column_linears", COLUMN_LINEARS), ("cp_ring", CP_RINGS),
                                    ("grad_buffer", DTYPE_CHOICES), ("reduce_dtype", DTYPE_CHOICES),
                                    ("optimizer_state", DTYPE_CHOICES), ("expert_tp", EXPERT_TPS),
                                    ("expert_ranks", EXPERT_RANKS), ("tp_overlap_impl", TP_OVERLAP_IMPLS),
                                    ("zero1_reduce", ZERO1_REDUCES), ("fp8_impl", FP8_IMPLS),
                                    ("grad_accumulate", GRAD_ACCUMULATES)))
        _ = self.kernels  # its checks of the norm, rotary and matmul names (kernels.Kernels)

    @property
    def software(self) -> Software:
        return Software(attention=self.attention, grad_sync=self.grad_sync)

    @property
    def kernels(self) -> Kernels:
        """How this engine runs a layer's memory-bound kernels (``kernels.Kernels``): its norm and
        rotary kernels, and its SwiGLU and attention as the kernels its ``glu_saves`` and
        ``qkv_saves`` name keep (a fused SwiGLU keeps its input; an attention kernel that takes k
        and v at their kv heads keeps them so)."""
        return Kernels(norm=self.norm, rope=self.rope, glu="fused" if self.glu_saves == "input" else "separate",
                       kv="native" if self.qkv_saves == "fused" else "repeated", matmul=self.matmul,
                       attention_padding=self.attention_padding, fp8=self.fp8_impl)

    @property
    def selective_keeps(self) -> str:
        """What a selectively recomputed block keeps, as ``analytic`` counts it
        (``analytic.SELECTIVE_KEEPS``); the "attention" scope keeps what no recomputation does."""
        return "alternate" if self.selective_scope == "alternate" else "ops"

    def reruns_communication(self, recompute: str) -> bool:
        """Whether a layer recomputed under ``recompute`` runs its forward's communication again
        (tensor-parallel collectives, a mixture's all-to-alls, split experts' gathers, the
        balancing statistics): under full recomputation, and under a selective scope that reruns
        the block up to its last product ("ops", "alternate"); Megatron-LM's attention-core scope
        recomputes nothing that communicates."""
        return recompute == "full" or (recompute == "selective" and self.selective_scope != "attention")

    def with_options(self, options: Mapping[str, object], where: str = "engine") -> "Engine":
        """This engine with some behaviours changed (a published run's own configuration)."""
        fields = {f.name: f.type for f in dataclasses.fields(self) if f.name != "name"}
        for key, value in options.items():
            if key not in fields:
                raise PartitaError(f"{where}: unknown option {key!r}; valid: {', '.join(fields)}")
            if fields[key] == "bool" and not isinstance(value, bool):
                raise PartitaError(f"{where}: {key} must be true or false, got {value!r}")
            if fields[key] == "str" and not isinstance(value, str):
                raise PartitaError(f"{where}: {key} must be a name, got {value!r}")
            if fields[key] == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PartitaError(f"{where}: {key} must be a positive whole number, got {value!r}")
        try:
            return dataclasses.replace(self, **options)
        except PartitaError as e:
            raise PartitaError(f"{where}: {e}") from None


ENGINES: dict[str, Engine] = {
    # partita launch: torch SDPA (the H200 fit), FSDP2 units per block, DDP/FSDP2 reductions as
    # the backward frees each layer's gradients, torch.distributed.pipelining with receive
    # buffers allocated as receives are posted, the chunked loss, and the column-parallel
    # products of one input run as one function (runtime.tp_linear): the sequence shard kept and
    # gathered again in the backward, the input gradient's reduction beside the weight gradients.
    "partita": Engine("partita", dgrad_overlap=True, p2p_overlap=True, sp_inputs="sharded", p2p_buffers="on_receive",
                      shard_copies="fsdp2"),
    # torchtitan as partita export --to torchtitan writes it: the same torch stack (SDPA, FSDP2
    # per block, torch pipelining), eager (async TP needs compile); its loss casts the logits to
    # fp32 (torchtitan/components/loss.py, cross_entropy_loss: pred.flatten(0, 1).float()); its
    # selective recomputation is the "op" policy the export writes.
    # Its FP8 products are torchao's Float8Linear (tensorwise dynamic scaling, the output layer
    # left in bf16) with FSDP's float8 all-gather, as torchtitan's float8 docs recommend and the
    # export writes.
    "torchtitan": Engine("torchtitan", p2p_overlap=True, loss="fp32", selective_scope="alternate", shard_copies="fsdp2",
                         tp_overlap_impl="symmetric_memory", fp8_impl="torchao_hp", fp8_gather=True),
    # Megatron-LM as partita export --to megatron writes it: Transformer Engine's attention, which
    # on Hopper and later prefers cuDNN's fused attention over FlashAttention ("Disabling
    # FlashAttention to give FusedAttention preference on Hopper+", dot_product_attention/utils.py,
    # get_attention_backend; since TE commit 225b560, 2023-12) and runs FlashAttention-2 on Ampere,
    # where the cudnn curve is priced as FlashAttention-2's (search/roofline.py), --overlap-grad-reduce,
    # the interleaved schedule's p2p overlap (the training script's default), the column-parallel
    # input-gradient reductions beside the weight gradients (always on), selective recomputation of
    # the attention core alone (--recompute-granularity selective), --tp-comm-overlap under sequence
    # parallelism (Transformer Engine's userbuffers, set up by Megatron itself: initialize.py,
    # _initialize_tp_communicators, NCCL bootstrap by default since Transformer Engine 1.9),
    # its fused SwiGLU, rotary kernel and GQA-native attention (their time and saved tensors),
    # and Transformer Engine's context-parallel ring.
    "megatron": Engine("megatron", attention="cudnn", column_linears="fused", tp_overlap=True, p2p_overlap=True, dgrad_overlap=True,
                       expert_ranks="folded",
                       selective_scope="attention", loss="fp32_in_place", fp16_grad_reduce=True,
                       sp_inputs="sharded", p2p_buffers="per_transfer", glu_saves="input", qkv_saves="fused",
                       cp_ring="transformer_engine", rope="fused"),
    # DeepSpeed as partita export --to deepspeed writes it (ZeRO 0-3 with overlap_comm): ZeRO-3's
    # module-by-module gathers, run after the compute they feed as its published runs measured,
    # ZeRO-2's parameters whole and gathered once a step, a Hugging Face model's fp32 loss, torch SDPA.
    "deepspeed": Engine("deepspeed", zero3_gathers="module", zero3_overlap=False, zero2_gather="step",
                        param_gather="after_step", loss="fp32", fp16_grad_reduce=True),
}
DEFAULT_ENGINE = "partita"
assert tuple(ENGINES) == parallel.ENGINES, "the rule book names the same engines"


# What else an engine changes when it runs a plan's FP8 products: torchtitan's float8 runs under
# torch.compile (the export turns it on), which since 2025 compiles the loss too (torchtitan/
# components/loss.py): no fp32 logits kept, as "chunked" prices it.
FP8_RUNS = {"torchtitan": {"loss": "chunked"}}


def get_engine(name: str | None, fp8: bool = False) -> Engine:
    """The engine by name (None: Partita's runtime), with its blocks' products in FP8 where the
    plan asks (``Plan.fp8``: ``matmul`` "fp8", and ``FP8_RUNS``); an unknown name is one clear error."""
    if name is None:
        name = DEFAULT_ENGINE
    if name not in ENGINES:
        raise PartitaError(f"unknown engine {name!r}; valid: {', '.join(ENGINES)}")
    return dataclasses.replace(ENGINES[name], matmul="fp8", **FP8_RUNS.get(name, {})) if fp8 else ENGINES[name]


def plan_engine(plan) -> Engine:
    """The engine a plan (``partita.plan.Plan``) is priced for, as it runs that plan."""
    return get_engine(plan.engine, plan.fp8)


def linear_modules(kind, *, local_experts: int = 0) -> int:
    """The modules of a layer (``partita.model.LayerKind``) whose parameters DeepSpeed's ZeRO-3
    gathers one at a time: every linear layer and embedding table (norm weights stay whole,
    under the persistence threshold). A block's dense part: q, k, v, o (gpt2: a fused qkv and
    o) and the MLP's two (gpt2) or three (gated) products; of a mixture-of-experts block the
    router and a shared expert's three instead of the MLP, and ``local_experts`` x 3 for the
    experts a rank holds (``experts.zero_traffic``)."""
    if local_experts:
        return 3 * local_experts
    if kind.role in ("embed", "head"):
        return 1 + (kind.learned_positions > 0)
    attention = 2 if kind.family == "gpt2" else 4
    if kind.experts:
        return attention + 1 + (3 if kind.shared_expert_ffn else 0)
    return attention + (2 if kind.family == "gpt2" else 3)


def zero3_gathers(engine: Engine, kind, *, local_experts: int = 0) -> int:
    """All-gathers ZeRO-3 runs for one layer's parameters in one pass under ``engine``."""
    return linear_modules(kind, local_experts=local_experts) if engine.zero3_gathers == "module" else 1



def block_module_params(kind, tp: int) -> list[list[int]] | None:
    """A dense block's linear modules in forward order, each its parameter tensors' sizes on one
    tensor-parallel rank (weight, then bias where it has one): gpt2's fused qkv, o, w1, w2;
    llama's q, k, v, o, w1, w3, w2. None for other layers (embedding, head, a mixture of experts)."""
    if kind.role != "block" or kind.experts:
        return None
    h, f = kind.hidden, kind.ffn // tp
    q, kv = kind.heads * kind.head_dim // tp, kind.kv_heads * kind.head_dim // tp
    if kind.family == "gpt2":
        return [[h * 3 * q, 3 * q], [q * h, h], [h * f, f], [f * h, h]]
    qkv = [[h * q, q], [h * kv, kv], [h * kv, kv]] if kind.qkv_bias else [[h * q], [h * kv], [h * kv]]
    return qkv + [[q * h], [h * f], [h * f], [f * h]]


def recompute_regathers(kind, tp: int, reuse_distance: int = DEEPSPEED_MAX_REUSE_DISTANCE) -> list[int]:
    """The parameters of each module a recomputed (checkpointed) dense block gathers a third time
    under DeepSpeed's ZeRO-3: its backward runs the recomputed forward (every module gathered
    again, released after it unless reused soon) and then the modules' backward in reverse
    order. Module j is kept from its recompute to its backward only if the parameters traced in
    between, 2 x those of the modules after it, are within ``reuse_distance``; the rest are
    gathered once more for their backward. The last module always stays. Empty for a layer
    ``block_module_params`` does not list."""
    modules = block_module_params(kind, tp)
    if not modules:
        return []
    sizes = [sum(m) for m in modules]
    return [sizes[j] for j in range(len(sizes)) if 2 * sum(sizes[j + 1:]) > reuse_distance]


def reduce_flushes(kind, tp: int, bucket: int) -> int:
    """Reduce-scatters DeepSpeed's ZeRO-3 runs for one block's gradients: they enter a bucket of
    ``bucket`` elements in the backward's order, and a bucket holding anything is reduced before a
    gradient that would overflow it (stage3.py, ``reduce_independent_p_g_buckets_and_remove_grads``),
    so a gradient larger than the bucket is reduced alone. Counted as the flushes per block of
    the block repeated (its last bucket carried into the next); 1 for a layer
    ``block_module_params`` does not list."""
    modules = block_module_params(kind, tp)
    if not modules:
        return 1
    grads = [p for m in reversed(modules) for p in reversed(m)]
    flushes, held = 0, 0
    for _ in range(2):  # the second pass counts a block that starts with the one before's bucket
        count = 0
        for p in grads:
            if held > 0 and held + p > bucket:
                count += 1
                held = 0
            held += p
        flushes = count
    return max(1, flushes)


def largest_module_params(kind, tp: int) -> int:
    """The parameters of a layer's largest linear module on one tensor-parallel rank: what a
    module-by-module ZeRO-3 (DeepSpeed) holds gathered at once, beside the next one it prefetches.
    A block: the MLP's widest product (hidden x ffn), or gpt2's fused qkv (3 hidden^2) if wider;
    embedding and head: the vocabulary's table."""
    if kind.role in ("embed", "head"):
        return kind.vocab * kind.hidden // tp
    attention = 3 * kind.hidden * kind.hidden if kind.family == "gpt2" else kind.hidden * kind.hidden
    mlp = kind.hidden * (kind.shared_expert_ffn if kind.experts else kind.ffn)
    return max(attention, mlp) // tp
