"""torchrefit's own device kernels, each compiled or JIT-built at first use:

* ``copy_runs``: one CUDA kernel (NVRTC) that copies many byte runs in one launch;
* ``elementwise_copies``: large copies as elementwise kernels on wider views of the bytes;
* ``delta_blocks``: delta refits' diff, encode and apply (Triton);
* ``fp8_blocks``: block FP8 quantization of many regions in one launch (Triton);
* ``region_checksums``: ``verify()``'s checksum of many regions in one launch (Triton);
* ``image_cache``: compiled kernel images kept on disk for later processes.
"""
