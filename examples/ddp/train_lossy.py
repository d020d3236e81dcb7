"""train.py with the scenario's collective (lossy, say) as DDP's communication hook.

Run by `testbed run scenario-lossy.yaml`: the hook comes from the scenario (`testbed.ddp`), so the
gradients travel as the collective under study moves them; the script is train.py's.
"""

from train import main

from testbed.ddp import scenario_hook

if __name__ == "__main__":
    main(comm_hook=scenario_hook)  # the one line that differs from `python train.py`
