<?php

/**
 * phorge-bridge's scripts/bench, inside its scratch copy of Phorge:
 *
 *   php helper.php PHORGE_ROOT setup DOCUMENTS
 *
 * makes (or finds) the bench's administrator bot with a Conduit API token, and
 * DOCUMENTS - 1 more users whose PHIDs, with the bot's, are the documents the
 * PhabricatorSearchWorker tasks re-index; then says whether Phorge's loader
 * finds the bench's no-op class. Prints one JSON object.
 */
$root = $argv[1];
require_once $root.'/scripts/init/init-script.php';

const BENCH_NOOP_CLASS = 'PhorgeBridgeBenchNoopWorker';

function bench_user($viewer, $name, $admin, $bot) {
  $user = id(new PhabricatorPeopleQuery())
    ->setViewer($viewer)
    ->withUsernames(array($name))
    ->executeOne();
  if ($user) {
    return $user;
  }
  $user = id(new PhabricatorUser())
    ->setUsername($name)
    ->setRealName('Bench '.$name)
    ->setIsApproved(1)
    ->setIsAdmin($admin ? 1 : 0)
    ->setIsSystemAgent($bot ? 1 : 0);
  $email = id(new PhabricatorUserEmail())
    ->setAddress($name.'@example.com')
    ->setIsVerified(1);
  id(new PhabricatorUserEditor())
    ->setActor($viewer)
    ->createNewUser($user, $email);
  return $user;
}

function bench_token($viewer, PhabricatorUser $user) {
  $token = id(new PhabricatorConduitTokenQuery())
    ->setViewer($viewer)
    ->withObjectPHIDs(array($user->getPHID()))
    ->withTokenTypes(array(PhabricatorConduitToken::TYPE_STANDARD))
    ->withExpired(false)
    ->setLimit(1)
    ->executeOne();
  if (!$token) {
    $token = PhabricatorConduitToken::initializeNewToken(
      $user->getPHID(),
      PhabricatorConduitToken::TYPE_STANDARD);
    $token->save();
  }
  return $token->getToken();
}

$viewer = PhabricatorUser::getOmnipotentUser();
switch ($argv[2]) {
  case 'setup':
    $count = max(1, (int)$argv[3]);
    $bot = bench_user($viewer, 'bridgebenchbot', true, true);
    $documents = array($bot->getPHID());
    for ($n = 1; $n < $count; $n++) {
      $user = bench_user($viewer, sprintf('bridgebench%02d', $n), false, false);
      $documents[] = $user->getPHID();
    }
    echo json_encode(array(
      'token' => bench_token($viewer, $bot),
      'botPHID' => $bot->getPHID(),
      'admin' => (bool)$bot->getIsAdmin(),
      'documents' => $documents,
      'noopLoaded' => class_exists(BENCH_NOOP_CLASS)
        && is_subclass_of(BENCH_NOOP_CLASS, 'PhabricatorWorker'),
      'php' => PHP_VERSION,
    ));
    break;
  default:
    fwrite(STDERR, "usage: helper.php PHORGE_ROOT setup DOCUMENTS\n");
    exit(2);
}
