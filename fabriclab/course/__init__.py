"""The course's notebook tooling, on top of everything else: ``lesson`` (show a stage's source and its
diff, trace posts and completions), ``figures`` (the plots the lessons draw) and ``tour`` (run every
lesson headless, print the measured figures beside the article's). Nothing below imports from here."""
