from rollout_watchdog.cli import main

raise SystemExit(main())
