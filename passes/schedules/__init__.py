"""Pipeline schedules as data: actions per stage, generated, lowered, checked, simulated."""
