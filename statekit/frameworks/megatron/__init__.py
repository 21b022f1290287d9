"""Megatron-LM / Megatron-Core checkpoints: the shared foundation and the legacy reader.

- :mod:`.config`: what a checkpoint's pickled ``args`` say about the run (parallel sizes, the
  model's shape, bucket settings, precision, the mcore-version signals), refused by name where a
  needed fact is missing;
- :mod:`.buckets`: the distributed optimizer's bucket-space layout, a pure function of the ordered
  parameters, the settings and a version rule;
- :mod:`.names`: stage-local layer indices and local expert indices made global, the legacy
  ``mp_rank_*`` folder names resolved;
- :mod:`.proof`: every parameter's fp32 master proved against the stored weight before any state
  is called that parameter's;
- :mod:`.legacy`: ``model_optim_rng.pt`` (+ ``distrib_optim.pt``) folders as an
  :class:`~statekit.state.OptimizerState`;
- :mod:`.dist`: torch_dist folders (model-space sharding types), with :mod:`.stacking` (stacked
  layers and experts unstacked) and :mod:`.regions` (one parameter's box, the N-D reformulation).

See ``docs/megatron.md``.
"""
