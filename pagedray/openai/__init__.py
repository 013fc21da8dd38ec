"""The OpenAI server, free of Ray: request and response models, strict body decoding, prompts
from bodies, SSE chunks, usage and logprob formats, error JSON, the HTTP guard, and the routes
(`routes/`) over one `OpenAIServer` written against an `EngineClient`. The Serve ingress in
`cluster/ingress_deployment.py` runs it over the engine deployment; `local_app.py` over an
engine in this process."""
