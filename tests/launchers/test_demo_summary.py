"""The demo's closing lines point at the committed learning-signal plot and state its numbers."""

import os

from experiments import demo


def test_signal_summary_names_the_committed_plot_and_its_numbers():
  text = demo.signal_summary()
  assert demo.SIGNAL_PNG in text
  assert os.path.isfile(demo.SIGNAL_PNG), demo.SIGNAL_PNG
  assert "9/64" in text and "44/64" in text and "30 RL steps" in text
  assert "make signal" in text


def test_make_signal_runs_the_rl_signal_launcher_as_documented():
  with open(os.path.join(demo.REPO, "Makefile")) as f:
    makefile = f.read()
  assert "\nsignal: setup\n" in makefile
  assert "experiments.rl_signal --workdir=$(SIGNAL_DIR) --sft_steps=300 --rl_steps=30" in makefile
