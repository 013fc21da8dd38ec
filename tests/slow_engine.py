"""An engine whose steps sleep, for tests that need requests to last (scaling, draining, a node
failure): `build_engine` with `executor.execute_model` delayed.

Ray's workers cannot import the tests, so this module is pickled by value: the builder travels
to the engine replica whole, as a nested function of a test module would.
"""

from __future__ import annotations

import sys
from typing import Any

from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def slow_engine_builder(step_sleep_s: float) -> Any:
    """An `engine_builder` (see `build_openai_app`) whose every step first sleeps this long."""

    def slow_builder(config: Any) -> tuple[Any, Any, Any, Any]:
        import time

        from pagedray.cluster.ray_executor import executor_factory
        from pagedray.engine.engine_factory import build_engine

        # As the engine replica's own builder: ranks in its process, or actors at TP > 1.
        make_executor = executor_factory(config)
        engine, executor, tokenizer, validator = build_engine(config, make_executor=make_executor)
        execute_model = executor.execute_model

        def slow_execute_model(scheduler_output: Any) -> Any:
            time.sleep(step_sleep_s)
            return execute_model(scheduler_output)

        executor.execute_model = slow_execute_model
        return engine, executor, tokenizer, validator

    return slow_builder
