from statekit.cli import main

main()
