"""The schedule model (floor 2, beside the state model): learning-rate schedules as functions of the
step, their position and the trainer's counters (:mod:`statekit.schedule.model`), and each
framework's arithmetic as pure functions (``torch_lr``, ``hf_lr``, ``burn_lr``). Readers that build
it from files are on the frameworks floor (``statekit/frameworks/schedule_*.py``)."""
