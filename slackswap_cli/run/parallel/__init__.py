"""Pipeline and tensor parallelism on the run side: plan_pipeline (pipeline.py) over torch's
schedules, models split by torch's pipeline() (pipe_stages.py), what a split backward holds
(split_backward.py), and DTensor runs on local shards (dtensor.py). The torch-free schedule,
memory and copy models are slackswap_cli/pipeline/.
"""
