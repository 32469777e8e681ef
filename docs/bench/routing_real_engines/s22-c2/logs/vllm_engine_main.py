import os

if os.environ.get("CORTEX_VLLM_BLOCK16") == "1":
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
        lambda kv_cache_spec=None: [MultipleOf(16)])

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
