"""The checkpoint formats: HF safetensors (:mod:`~ckpt_tools.formats.hf`), Megatron-core torch_dist
(:mod:`~ckpt_tools.formats.torch_dist`: the format and its writer; :mod:`~ckpt_tools.formats.torch_dist_reader`;
:mod:`~ckpt_tools.formats.safe_pickle` for its ``.metadata``; every untrusted pickle and zip is read through
:mod:`~ckpt_tools.formats.safe_pickle`, :mod:`~ckpt_tools.formats.pickle_scan` and
:mod:`~ckpt_tools.formats.zip_records`), verl's FSDP rank files (:mod:`~ckpt_tools.formats.fsdp`), vLLM ``sharded_state`` shards
(:mod:`~ckpt_tools.formats.vllm_format`), and every one of them seen as a view of HF tensor space
(:mod:`~ckpt_tools.formats.views`)."""
