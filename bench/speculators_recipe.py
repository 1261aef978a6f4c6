"""speculators 0.9's EAGLE-3 defaults as overrides of our run config ("B" in results-vs-speculators-recipes-cpu.txt):
Muon, its three norms, equal TTT step weights, the draft head taken from the target's and frozen, decay to 0.
bench/levers.py varies around it; bench/gpu_step.py times our step with it beside speculators' own."""

SPECULATORS_NORMS = ["drafter.norm_before_fc=true", "drafter.norm_output=true", "drafter.norm_before_residual=true"]
SPECULATORS_RECIPE = ["train.optimizer=muon", *SPECULATORS_NORMS, "ttt.step_weight=1.0", "train.lm_head_init=target",
                      "train.freeze_lm_head=true", "train.min_lr_ratio=0.0"]
