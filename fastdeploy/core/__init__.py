"""Types every process shares: requests and their status, sampling params, step hand-offs, outputs.

The ground floor of the package: modules here import only the standard library,
third-party packages, ``fastdeploy.core``, ``fastdeploy.envs`` and
``fastdeploy.config`` (``tests/test_import_layering.py`` checks it), so the
front end, the engine core, the scheduler and the workers can all build on them.

* ``request``: ``EngineCoreRequest`` / ``EngineCoreOutputs`` (the ZMQ messages), ``Request``
  (the engine core's bookkeeping), ``RequestStatus``, ``FinishReason``, ``SchedulerStats``.
* ``sampling_params``: ``SamplingParams`` and its limits.
* ``step_io``: ``SchedulerOutput`` (scheduler → workers) and ``ModelRunnerOutput`` (workers → scheduler).
* ``outputs``: ``RequestOutput``, ``CompletionOutput``, ``Logprob`` (what users get back).
* ``prompt_logprobs``: prompt logprobs gathered in the engine core, turned into ``Logprob`` s in the front end.
* ``mm_item``: ``MMItem``, a placed multimodal item, and its msgpack-friendly wire form.
"""
