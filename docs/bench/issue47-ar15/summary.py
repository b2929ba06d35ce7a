# Issue 47's one summary script (issue47-skip/summary.py), run on this folder's runs.
import os, runpy
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../issue47-skip/summary.py"), run_name="__main__")
