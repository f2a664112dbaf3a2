"""Small private helpers every layer may use: the cache directory (``cache_dir``), the
caller's torch modes (``caller_state``), CUDA driver calls (``cuda_driver``), how
quantities are written (``format``), the GC pause (``gc_pause``), identity without
``id()`` (``identity``), rows two strided regions share (``strides``) and models held
weakly (``weak_models``). None of them imports anything of torchrefit above ``settings``.
"""
