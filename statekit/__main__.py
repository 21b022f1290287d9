from statekit.entry import main

main()
