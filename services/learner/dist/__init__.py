"""The learner across ranks: torch.distributed set-up and the rank-0-led op protocol.

Process layout (``torchrun --nproc-per-node N -m rlbus.learner.main --config FILE``; one CPU process is
the degenerate case and runs none of the distributed code):

* **rank 0** runs the asyncio learner service (bus, dispatch, rollout replicas, the weight push). Each
  time it needs the other ranks it *leads* one operation over the default process group:

  ============  =====================================  ==============================================
  op            payload                                 sent by
  ============  =====================================  ==============================================
  ``INIT``      ``{model_path, total_steps}``           ``PolicyTrainer.__init__`` (workers build theirs)
  ``TRAIN``     the collated ``TrainBatch``             ``PolicyTrainer.train_step``
  ``GATHER``    none                                    the first ``next()`` of ``named_weights()``
  ``CALL``      ``{name, kwargs}`` (JSON)               ``DistContext.lead_call``: service.py leads
                                                        ``save_checkpoint``, ``load_checkpoint``, ``save_hf``
  ``STOP``      none                                    ``run_learner`` when the service returns
  ============  =====================================  ==============================================

* **rank k > 0** runs :func:`rlbus.learner.dist.worker.worker_main`: ``receive op -> run it`` until ``STOP``.
  It never touches NATS or a replica; it trains on its share of every batch and takes part in every
  all-gather of the weights.

An op is an int64 header broadcast from rank 0 on the CPU (gloo) side of the default group, then its
payload (JSON bytes, then the batch tensors, all on the CPU side: a batch is token ids, a few MB). On GPU
the default group is ``cpu:gloo,cuda:nccl``: workers idle in a gloo broadcast between steps (no NCCL
watchdog fires while rank 0 waits minutes for rollouts) and FSDP's collectives run on NCCL.

Data parallelism: every rank receives the whole batch, computes the advantages of the whole batch (GRPO
groups never straddle ranks), then trains on its share of each mini-batch (sequences dealt longest first
to the least-loaded rank). Losses are normalised by the mini-batch's GLOBAL token (or sequence) count
divided by the world size, and FSDP averages gradients over ranks, so N ranks compute exactly the
gradient one process computes on the same batch. Every rank must run the same number of forward and
backward passes (each one is a collective): the micro-batch count is all-reduced (max) and a rank with
fewer splits its largest micro-batch or, with nothing left, runs a masked dummy (zero loss, zero grad).

Weights: :func:`rlbus.learner.model.full_state_items` yields ``(name, full tensor)`` one parameter at a time (a DTensor's
``full_tensor()``), so a push never holds more than one unsharded parameter (plus the sender's bucket).
With LoRA it yields the MERGED weights under the base model's names (``W + scale * B @ A``), so every
rollout engine loads them as a plain state dict and never needs to know about adapters.
"""
