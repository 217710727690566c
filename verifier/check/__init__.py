"""The trusted checker process: references, inputs, comparison, timing and the runtime verdict. Never
imports candidate-side code."""
