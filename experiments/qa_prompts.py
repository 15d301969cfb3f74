"""Real-text prompts shared by the experiments that ask a small instruct model questions: a
few-shot prompt (the shared prefix) and short factual questions below it."""

FEWSHOT = (  # long enough that storing it once saves more KV than the tree's private pages cost
    'Answer each question in a few words.\n\n'
    'Question: What is the capital of France?\nAnswer: Paris.\n\n'
    'Question: How many legs does a spider have?\nAnswer: Eight.\n\n'
    'Question: What is the chemical symbol for gold?\nAnswer: Au.\n\n'
    'Question: Who painted the Mona Lisa?\nAnswer: Leonardo da Vinci.\n\n'
    'Question: What is the tallest mountain on Earth?\nAnswer: Mount Everest.\n\n'
    'Question: How many continents are there?\nAnswer: Seven.\n\n'
    'Question: What language is spoken in Brazil?\nAnswer: Portuguese.\n\n'
    'Question: Which animal is known as the king of the jungle?\nAnswer: The lion.\n\n'
    'Question: What is the freezing point of water in degrees Celsius?\nAnswer: Zero degrees.\n\n'
    'Question: Who was the first person to walk on the Moon?\nAnswer: Neil Armstrong.\n\n'
)

# 64 short factual questions: real text whose answers a small instruct model mostly knows.
QUESTIONS = tuple(f'What is the capital of {c}?' for c in (
    'Germany', 'Italy', 'Spain', 'Japan', 'Canada', 'Egypt', 'Brazil', 'Australia', 'India',
    'Russia', 'Mexico', 'Kenya', 'Norway', 'Greece', 'Turkey', 'Argentina')) + (
    'What is the largest planet in the solar system?', 'Who wrote the play Romeo and Juliet?',
    'What is the boiling point of water in degrees Celsius?', 'Which ocean is the largest?',
    'What gas do plants take in from the air?', 'How many days are there in a week?',
    'What is the freezing point of water in degrees Fahrenheit?', 'Who wrote Pride and Prejudice?',
    'What is the square root of 81?', 'How many planets are in the solar system?',
    'What is the smallest prime number?', 'Which planet is known as the Red Planet?',
    'What is the hardest natural substance?', 'Who developed the theory of relativity?',
    'What is the longest river in Africa?', 'How many hours are in a day?',
    'What language is spoken in Argentina?', 'What is the main ingredient of guacamole?',
    'What is the currency of Japan?', 'Which animal has a trunk?',
    'How many sides does a hexagon have?', 'What is the largest country by area?',
    'Who discovered penicillin?', 'What is H2O commonly called?',
    'Which organ pumps blood through the body?', 'What is the largest mammal?',
    'In which country are the pyramids of Giza?', 'What color is the sky on a clear day?',
    'How many minutes are in an hour?', 'What do bees make?',
    'What is the capital city of the United States?', 'Which metal is liquid at room temperature?',
    'What is the opposite of hot?', 'How many strings does a standard guitar have?',
    'What is the closest star to Earth?', 'Who invented the telephone?',
    'What is 12 times 12?', 'Which continent is Egypt in?',
    'What is the largest desert in the world?', 'How many players are on a soccer team?',
    'What instrument has 88 keys?', 'What is the primary language of Mexico?',
    'Which bird is a symbol of peace?', 'What is frozen water called?',
    'How many weeks are in a year?', 'Which season comes after winter?',
    'What is the chemical symbol for iron?', 'Who wrote Hamlet?')
