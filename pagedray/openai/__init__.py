"""The OpenAI protocol layer, free of Ray: request and response models, strict body decoding,
prompts from bodies, SSE chunks, usage and logprob formats, error JSON and the HTTP guard. The
Serve ingress in `cluster/ingress_deployment.py` is built from it."""
