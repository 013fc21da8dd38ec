"""The engine client, free of Ray and of HTTP: the offline `LLM`, the asyncio step loop, output
processing, prompt validation, admission, the in-process executor, engine construction and
config. The Serve deployments in `cluster/` wrap it; an import-boundary test keeps it Ray-free."""
