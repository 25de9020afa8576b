"""The planner, above the engine: will a configuration fit, and which to use (``predict_peak``, ``plan``,
``mindzero-plan``), from rehearsals of replicas of the user's network in processes of their own."""
