"""The written-out step: the joint graph split by the plan's layout and written as forward and
backward code (code.py), run as one autograd node (step.py: `step_module(model)`).
"""
