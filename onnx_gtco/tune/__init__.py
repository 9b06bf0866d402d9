"""Kernel tuning with Optuna over a tuning database every run reuses (tasks, search, scheduler, driver)."""
