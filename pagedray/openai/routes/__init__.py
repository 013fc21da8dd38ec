"""The OpenAI server's routes, one module per API family, each an `APIRouter` whose routes take
their `OpenAIServer` as a dependency (`openai_server`); `openai_app.py` joins them into an app.
"""
