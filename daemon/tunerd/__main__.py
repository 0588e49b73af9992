from tunerd.cli.main import main

raise SystemExit(main())
