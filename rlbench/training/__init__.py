"""Training: one step of rollout -> reward -> advantage inputs -> advantages -> update -> metrics.

    step.py              train_step and its named stages; StepContext, built once by make_step_context
    loop.py              the loop over steps (prompt order, steps without trainable tokens)
    batch.py             TrainBatch, collate, micro-batches, DAPO's overlong mask
    forward.py           token_outputs: the one function for token log-probs (entropy, values)
    packing.py           the packed forward's layout and attention (each prompt once, no padding)
    token_log_probs.py   log pi(o_t) and entropy from the logits without the [tokens, vocabulary] log-softmax
    update.py            the micro-batch objective and the standard update schedule
    update_schedules.py  the schedules' driver: standard, sfpo, trpo, the EWMA proximal policy
    advantage_inputs.py  inputs that need more than the batch (ReMax/PVPO baselines, SPO tracker,
                         polychromic answer keys) and the checks of their options

Dependencies point one way: rlbench.algorithm <- rlbench.rollout <- rlbench.training <- rlbench.runner.
"""
