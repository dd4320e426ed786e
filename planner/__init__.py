"""The planner (schedule.py is its entry point): one concept per module.

  specs           the inputs: cluster (GPUs and links), model, workload, achieved fractions of peak
  cost_model      the formulas: a replica's throughput, memory, a training step, a weight sync, the step
  search          phase 1 (trainer layout, rollout replica MILP) and phase 2 (the split of the GPUs): the Planner
  calibration     efficiency constants fitted to a measured run, or to a numpy matmul / memcpy
  device_profile  this machine's device measured with the runtime's own code (`schedule.py profile`)
  profile_fit     the device profile file: its checks, applying it, fitting its points into the constants
  simulate        the discrete-event simulator of a plan's asynchronous pipeline
  memory          every rank's peak device memory, from the runtime's code on fake tensors
  run_prediction  a recorded run's own split priced with a device profile
The CPU bench's pricing of its host plugs in through specs.Cluster.speeds (cpu_bench/host.py).
"""
